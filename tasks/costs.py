"""What orchestration costs an RL step. Every task body's wall time adds to a running total of work (`work`); the
MLflow writes (`mlflow`) and the Prefect API calls our code makes (`prefect`: artifacts) add to totals of their own
and, made inside a task body, are taken out of its work. The step's artifacts are made off its path
(rstar2.tasks.publish): they add to the `prefect` total, not to the step's wall time. A step's wall time less its work
is what orchestration cost it: the MLflow writes, and the rest is Prefect's (task and flow runs: API calls, state
changes, parameter handling; our artifact calls).

Tasks run in the flow's process and thread (Prefect 3 runs a sync task where it is called), so one process-wide
total per kind serves every flow of the process; a step reads the totals at its start and its end (`mark`)."""

from __future__ import annotations

import functools
import threading
import time
from contextlib import contextmanager

_TOTALS = {"work": 0.0, "mlflow": 0.0, "prefect": 0.0}
_LOCK = threading.Lock()
_IN_WORK = threading.local()  # depth of task bodies running on this thread


def _add(kind: str, seconds: float) -> None:
    with _LOCK:
        _TOTALS[kind] += seconds


def work(fn):
    """A task body whose wall time counts as the step's work (put it under @task)."""
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        _IN_WORK.depth = getattr(_IN_WORK, "depth", 0) + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _IN_WORK.depth -= 1
            _add("work", time.perf_counter() - t0)

    return timed


@contextmanager
def _orchestration(kind: str):
    t0 = time.perf_counter()
    try:
        yield
    finally:
        took = time.perf_counter() - t0
        _add(kind, took)
        if getattr(_IN_WORK, "depth", 0):
            _add("work", -took)


def mlflow():
    """Around MLflow writes: orchestration, not the step's work, wherever they are made."""
    return _orchestration("mlflow")


def prefect():
    """Around Prefect API calls our code makes (artifacts): orchestration, not the step's work."""
    return _orchestration("prefect")


def snapshot() -> dict[str, float]:
    with _LOCK:
        return dict(_TOTALS)


def mark() -> tuple[float, dict[str, float]]:
    """Where a step's window begins or ends: the clock and the totals."""
    return time.perf_counter(), snapshot()


def overhead(start: tuple[float, dict[str, float]], end: tuple[float, dict[str, float]]) -> dict[str, float]:
    """A step's orchestration cost over its window (`mark` at its start and end):
        work_s = task bodies' time less the orchestration calls in them, mlflow_s = MLflow writes' time,
        prefect_s = wall_s - work_s - mlflow_s (of which api_s our Prefect API calls),
        orchestration_overhead_frac = (wall_s - work_s) / wall_s."""
    wall_s = end[0] - start[0]
    d = {k: end[1][k] - start[1][k] for k in _TOTALS}
    return {"orch_wall_s": wall_s, "orch_work_s": d["work"], "orch_mlflow_s": d["mlflow"],
            "orch_prefect_s": max(0.0, wall_s - d["work"] - d["mlflow"]), "orch_prefect_api_s": d["prefect"],
            "orchestration_overhead_frac": max(0.0, wall_s - d["work"]) / wall_s if wall_s > 0 else 0.0}
