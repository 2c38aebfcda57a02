"""Progress of long work (SFT, rollouts, evaluation): a rich bar in a terminal, a plain line now and then in a log;
and the console commands print their tables on."""

from __future__ import annotations

import contextlib
import sys
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

LOG_EVERY_S = 60.0  # without a terminal: one line per minute of a long phase, none for a short one
LOG_WIDTH = 200  # without a terminal: columns a table may take (rich's default, 80, cuts a wide one's cells)


def console() -> Console:
    """Where a command prints: the terminal's width in a terminal; in a log or CI, wide enough for whole tables."""
    return Console(width=None if sys.stdout.isatty() else LOG_WIDTH)


@contextlib.contextmanager
def bar(label: str, every_s: float = LOG_EVERY_S):
    """Yields `update(done, total, loss_or_none)`: a transient bar when stderr is a terminal; else a line on stderr
    at most every `every_s` seconds (`[SFT] 412/1652 (25 %), loss 0.231, 301 s`), so a log shows a long phase moving."""
    if not sys.stderr.isatty():
        yield _lines(label, every_s)
        return
    with Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                  TimeElapsedColumn(), transient=True) as p:
        t = p.add_task(label, total=None, info="")

        def update(done: int, total: int, value: float | None = None) -> None:
            p.update(t, completed=done, total=total, info=f"loss {value:.3f}" if value is not None else "")

        yield update


def _lines(label: str, every_s: float):
    start = last = time.monotonic()

    def update(done: int, total: int, value: float | None = None) -> None:
        nonlocal last
        now = time.monotonic()
        if now - last < every_s:
            return
        last = now
        loss = f", loss {value:.3f}" if value is not None else ""
        print(f"[{label}] {done}/{total} ({100 * done / max(total, 1):.0f} %){loss}, {now - start:.0f} s",
              file=sys.stderr, flush=True)

    return update
