"""What orchestration costs an RL step. Every task body's wall time adds to a running total of work (`work`), the
MLflow writes inside task bodies to a total of their own (`mlflow`); a step's wall time less its tasks' work is
what Prefect's task and flow runs cost it (API calls, state changes, parameter handling).

Tasks run in the flow's process and thread (Prefect 3 runs a sync task where it is called), so one process-wide
total per kind serves every flow of the process; a step reads the totals before and after itself."""

from __future__ import annotations

import functools
import threading
import time
from contextlib import contextmanager

_TOTALS = {"work": 0.0, "mlflow": 0.0}
_LOCK = threading.Lock()


def _add(kind: str, seconds: float) -> None:
    with _LOCK:
        _TOTALS[kind] += seconds


def work(fn):
    """A task body whose wall time counts as the step's work (put it under @task)."""
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _add("work", time.perf_counter() - t0)

    return timed


@contextmanager
def mlflow():
    """Around a task's MLflow writes: their time is orchestration, not the step's work."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        _add("mlflow", time.perf_counter() - t0)


def snapshot() -> dict[str, float]:
    with _LOCK:
        return dict(_TOTALS)


def overhead(wall_s: float, before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """A step's orchestration cost from the totals before and after it:
        work_s = task bodies' time (MLflow writes included), mlflow_s = MLflow writes' time,
        prefect_s = wall_s - work_s,  orchestration_overhead_frac = (prefect_s + mlflow_s) / wall_s."""
    work_s = after["work"] - before["work"]
    mlflow_s = after["mlflow"] - before["mlflow"]
    prefect_s = max(0.0, wall_s - work_s)
    return {"orch_wall_s": wall_s, "orch_work_s": work_s - mlflow_s, "orch_prefect_s": prefect_s,
            "orch_mlflow_s": mlflow_s,
            "orchestration_overhead_frac": (prefect_s + mlflow_s) / wall_s if wall_s > 0 else 0.0}
