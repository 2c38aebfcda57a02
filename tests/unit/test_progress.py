"""Long phases report progress in a log too (no terminal): a line at most every `every_s` seconds, none for a phase
shorter than that; the lines are INFO records of the `rstar2.core.progress` logger (Prefect sends them to the run's
logs), with the context of the caller that opened the bar also when a worker thread reports."""

import contextvars
import logging
import threading

from rstar2.core import progress

RUN = contextvars.ContextVar("run", default=None)


def test_a_log_gets_a_line_per_interval(monkeypatch, caplog):
    caplog.set_level(logging.INFO, "rstar2")
    clock = iter([0.0, 10.0, 61.0, 90.0, 125.0])  # start, then one reading per update
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    with progress.bar("SFT", every_s=60) as update:  # pytest's captured stderr is no terminal
        update(1, 100, 2.5)  # 10 s: too soon
        update(40, 100, 0.91234)  # 61 s: a line
        update(60, 100)  # 90 s: 29 s after the last line
        update(100, 100, 0.2)  # 125 s: a line
    assert [(r.name, r.levelname, r.getMessage()) for r in caplog.records] == [
        ("rstar2.core.progress", "INFO", "[SFT] 40/100 (40 %), loss 0.912, 61 s"),
        ("rstar2.core.progress", "INFO", "[SFT] 100/100 (100 %), loss 0.200, 125 s")]


def test_a_short_phase_logs_nothing(caplog):
    caplog.set_level(logging.INFO, "rstar2")
    with progress.bar("rollout step 1") as update:
        for i in range(10):
            update(i + 1, 10)
    assert caplog.records == []


def test_a_bare_command_without_logging_prints_the_line_on_stderr(monkeypatch, capsys):
    """No handler, level WARNING (a command that set no logging up): the record would be dropped, so stderr."""
    monkeypatch.setattr(progress.log, "hasHandlers", lambda: False)
    with progress.bar("SFT", every_s=0) as update:
        update(1, 2, 0.5)
    assert capsys.readouterr().err.startswith("[SFT] 1/2 (50 %), loss 0.500, ")


def test_a_worker_thread_s_line_carries_the_opener_s_context(caplog):
    """Prefect finds a log line's run in the context: a line reported from another thread still names its run."""
    seen = []

    class Context(logging.Handler):
        def emit(self, record):
            seen.append((record.getMessage(), RUN.get()))

    handler = Context()
    logging.getLogger("rstar2.core.progress").addHandler(handler)
    caplog.set_level(logging.INFO, "rstar2")
    try:
        RUN.set("stage run 7")
        with progress.bar("rollout step 1", every_s=0) as update:
            worker = threading.Thread(target=update, args=(3, 4))
            worker.start()
            worker.join()
    finally:
        logging.getLogger("rstar2.core.progress").removeHandler(handler)
    assert len(seen) == 1 and seen[0][0].startswith("[rollout step 1] 3/4 (75 %), ") and seen[0][1] == "stage run 7"
