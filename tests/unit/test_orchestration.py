"""The orchestration layer's rules and its cost accounting: tasks and flows reach the actors only through the
Controller (no Ray calls, no dict of actors), and an RL step's orchestration overhead is its wall time less its
tasks' work, plus their MLflow writes (tasks/costs.py)."""

import ast
import time
from pathlib import Path

import pytest

from tasks import costs

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


def test_overhead_is_the_wall_less_the_work_plus_the_mlflow_writes():
    before = {"work": 10.0, "mlflow": 1.0}
    after = {"work": 19.0, "mlflow": 1.5}  # 9 s of task bodies, 0.5 s of it MLflow writes
    cost = costs.overhead(10.0, before, after)
    assert cost == pytest.approx({"orch_wall_s": 10.0, "orch_work_s": 8.5, "orch_prefect_s": 1.0,
                                  "orch_mlflow_s": 0.5, "orchestration_overhead_frac": 0.15})
    assert costs.overhead(0.0, before, before)["orchestration_overhead_frac"] == 0.0


def test_task_bodies_count_as_work_and_mlflow_writes_apart():
    @costs.work
    def body(x):
        with costs.mlflow():
            time.sleep(0.02)
        time.sleep(0.03)
        return x + 1

    before = costs.snapshot()
    assert body(1) == 2
    after = costs.snapshot()
    assert after["work"] - before["work"] >= 0.05
    assert 0.02 <= after["mlflow"] - before["mlflow"] < after["work"] - before["work"]
    with pytest.raises(ZeroDivisionError):  # a failing body is counted too
        costs.work(lambda: 1 / 0)()
    assert costs.snapshot()["work"] > after["work"]
