"""rstar2.tasks.run.run_context, the preamble every engine-driving flow enters, in a real flow (Prefect test harness,
MLflow on SQLite): it opens the run's MLflow run, hands over the run reference (world, MLflow ids, the Controller's id),
and on the way out stops the Controller and, for the run's own flow, ends the MLflow run FINISHED or FAILED. The world
is a stand-in task here (tests/flows/test_campaign_e2e.py builds the real one)."""

from pathlib import Path

import mlflow
import pytest
from prefect import flow, task

from rstar2.core import config
from rstar2.core.layout import RunLayout, WorldPaths
from rstar2.run.controller import Controller
from rstar2.tasks import run as run_mod


@task(name="build-world")
def _world(cfg, out_dir: str) -> dict:
    return {k: str(Path(out_dir) / k) for k in ("sft_problems", "train", "sft_data", "init_model")}


class Recording(Controller):
    stopped: list[str] = []

    def stop(self) -> None:
        Recording.stopped.append(self.run_id)
        super().stop()


@pytest.fixture()
def cfg(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(run_mod, "build_world", _world)
    monkeypatch.setattr(run_mod, "Controller", Recording)
    Recording.stopped.clear()
    return config.load("tiny", [f"out_dir={tmp_path}"])


def _status(cfg, run: Path) -> str:
    client = mlflow.MlflowClient(f"sqlite:///{Path(cfg.out_dir) / 'mlflow.db'}")
    exp = client.get_experiment_by_name(cfg.experiment)
    return client.search_runs([exp.experiment_id], f"tags.`rstar2.key` = '{run}'")[0].info.status


def test_the_run_s_own_flow_ends_its_mlflow_run_and_stops_the_controller(cfg):
    run, seen = Path(cfg.out_dir) / "ok", []

    @flow
    def campaign_like():
        with run_mod.run_context(cfg, RunLayout.at(run), "ok", {"kind": "campaign"}, owns_run=True,
                                 set_tags={"seeds": 1}) as ref:
            seen.append(run_mod.controller(ref))
            assert _status(cfg, run) == "RUNNING"
        return ref

    ref = campaign_like()
    assert ref.world == WorldPaths(**_world.fn(cfg, str(run / "world"))) and ref.layout.top == run
    assert _status(cfg, run) == "FINISHED" and Recording.stopped == ["ok"] and seen[0].run_id == "ok"
    with pytest.raises(RuntimeError, match="no open run with controller 'ok'"):
        run_mod.controller(ref)  # stopped and gone with its flow


def test_a_failing_flow_marks_its_run_failed_and_a_visitor_leaves_the_status_alone(cfg):
    run = Path(cfg.out_dir) / "bad"

    @flow
    def failing(owns: bool):
        with run_mod.run_context(cfg, RunLayout.at(run), "bad", {"kind": "campaign"}, owns_run=owns):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        failing(True)
    assert _status(cfg, run) == "FAILED" and Recording.stopped == ["bad"]
    with pytest.raises(RuntimeError, match="boom"):
        failing(False)  # e.g. a triggered evaluation: the campaign's run is not its to end
    assert _status(cfg, run) == "RUNNING"
