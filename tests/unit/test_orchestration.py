"""The orchestration layer's rules and its cost accounting: tasks and flows reach the actors only through the
Controller (no Ray calls, no dict of actors), and an RL step's orchestration overhead is its wall time less its
tasks' work, the MLflow writes and Prefect API calls made inside them not counting as work (tasks/costs.py)."""

import ast
import time
from pathlib import Path

import pytest

from rstar2.tasks import costs

ROOT = Path(__file__).resolve().parents[2]


def _modules():
    return sorted((ROOT / "tasks").glob("*.py")) + sorted((ROOT / "flows").glob("*.py"))


def test_tasks_and_flows_never_call_ray():
    """`ray.exceptions` (what a retry condition tells apart) is the only part of Ray they name."""
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "ray":
                assert node.attr == "exceptions", f"{path.name}:{node.lineno} ray.{node.attr}"


def test_no_task_or_flow_takes_a_dict_of_actors():
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                assert "actors" not in [a.arg for a in node.args.args], f"{path.name}: {node.name}"


def test_overhead_is_the_wall_less_the_work():
    start = (100.0, {"work": 10.0, "mlflow": 1.0, "prefect": 0.5})
    end = (110.0, {"work": 18.5, "mlflow": 1.5, "prefect": 0.6})  # 8.5 s of work net; 0.5 s MLflow, 0.1 s artifacts
    cost = costs.overhead(start, end)
    assert cost == pytest.approx({"orch_wall_s": 10.0, "orch_work_s": 8.5, "orch_prefect_s": 1.0,
                                  "orch_mlflow_s": 0.5, "orch_prefect_api_s": 0.1,
                                  "orchestration_overhead_frac": 0.15})
    assert costs.overhead(start, start)["orchestration_overhead_frac"] == 0.0


def test_task_bodies_count_as_work_less_the_orchestration_calls_in_them():
    @costs.work
    def body(x):
        with costs.mlflow():
            time.sleep(0.02)
        with costs.prefect():
            time.sleep(0.01)
        time.sleep(0.03)
        return x + 1

    before = costs.snapshot()
    with costs.mlflow():  # outside any task body: orchestration only
        time.sleep(0.01)
    assert body(1) == 2
    after = costs.snapshot()
    assert 0.03 <= after["work"] - before["work"] < 0.06  # the body's own 0.03 s; with its calls it would be >= 0.06
    assert 0.03 <= after["mlflow"] - before["mlflow"] < 0.06 and 0.01 <= after["prefect"] - before["prefect"] < 0.04
    with pytest.raises(ZeroDivisionError):  # a failing body is counted too
        costs.work(lambda: 1 / 0)()
    assert costs.snapshot()["work"] > after["work"]


def test_artifacts_are_published_in_order_off_the_path_in_the_callers_context(caplog):
    """tasks/publish.py: calls run on one thread in the order handed over, each seeing the caller's context variables
    (Prefect's run context: the artifact is filed under the run that made it); a failing call is logged, not raised."""
    import contextvars
    import threading

    from rstar2.tasks import publish

    who = contextvars.ContextVar("who", default="nobody")
    seen, gate = [], threading.Event()

    def record(i):
        gate.wait(5)
        seen.append((i, who.get(), threading.current_thread().name))

    def broken():
        raise RuntimeError("API down")

    token = who.set("task-run-7")
    try:
        futures = [publish.later(record, i) for i in range(5)] + [publish.later(broken)]
    finally:
        who.reset(token)
    assert seen == []  # the caller did not wait: the first call is still held at the gate
    gate.set()
    assert publish.drain(10) == 0
    assert [i for i, _, _ in seen] == [0, 1, 2, 3, 4]
    assert {w for _, w, _ in seen} == {"task-run-7"}
    assert {t for _, _, t in seen} != {threading.current_thread().name}
    assert futures[-1].result() is None and "API down" in caplog.text
