"""rich progress bars for long work (SFT, rollouts, evaluation) in the terminal."""

from __future__ import annotations

import contextlib
import sys

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


@contextlib.contextmanager
def bar(label: str):
    """Yields `update(done, total, loss_or_none)`; silent when stderr is not a terminal (CI logs stay readable)."""
    if not sys.stderr.isatty():
        yield lambda *a: None
        return
    with Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                  TimeElapsedColumn(), transient=True) as p:
        t = p.add_task(label, total=None, info="")

        def update(done: int, total: int, value: float | None = None) -> None:
            p.update(t, completed=done, total=total, info=f"loss {value:.3f}" if value is not None else "")

        yield update
