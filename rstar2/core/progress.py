"""Progress of long work (SFT, rollouts, evaluation): a rich bar in a terminal, a plain line now and then in a log
(logger `rstar2.core.progress` at INFO, which Prefect also sends to the run's logs); and the console commands print
their tables on."""

from __future__ import annotations

import contextlib
import contextvars
import io
import logging
import sys
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

LOG_EVERY_S = 60.0  # without a terminal: one line per minute of a long phase, none for a short one
LOG_WIDTH = 200  # without a terminal: columns a table may take (rich's default, 80, cuts a wide one's cells)
log = logging.getLogger(__name__)


def console() -> Console:
    """Where a command prints: the terminal's width in a terminal; in a log or CI, wide enough for whole tables."""
    return Console(width=None if sys.stdout.isatty() else LOG_WIDTH)


def text(renderable) -> str:
    """A rich renderable (e.g. a table) as plain text LOG_WIDTH wide, for a log line."""
    out = Console(width=LOG_WIDTH, file=io.StringIO(), color_system=None)
    out.print(renderable)
    return out.file.getvalue().rstrip()


@contextlib.contextmanager
def bar(label: str, every_s: float = LOG_EVERY_S):
    """Yields `update(done, total, loss_or_none)`: a transient bar when stderr is a terminal; else a line logged (INFO)
    at most every `every_s` seconds (`[SFT] 412/1652 (25 %), loss 0.231, 301 s`), so a log shows a long phase moving.
    The line carries the context of the caller that opened the bar (e.g. its Prefect task run), also when `update` is
    called from a worker thread."""
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
    caller = contextvars.copy_context()

    def update(done: int, total: int, value: float | None = None) -> None:
        nonlocal last
        now = time.monotonic()
        if now - last < every_s:
            return
        last = now
        loss = f", loss {value:.3f}" if value is not None else ""
        line = f"[{label}] {done}/{total} ({100 * done / max(total, 1):.0f} %){loss}, {now - start:.0f} s"
        caller.copy().run(_report, line)

    return update


def _report(line: str) -> None:
    """The line as an INFO record where logging prints it (a flow: Prefect's handlers, tasks/__init__.py); on stderr
    in a bare command that set no logging up (e.g. `rstar2 sft` into a file), where the record would be dropped."""
    if log.isEnabledFor(logging.INFO) and log.hasHandlers():
        log.info(line)
    else:
        print(line, file=sys.stderr, flush=True)
