"""Triggered evaluation (nightly, on-checkpoint) decides before starting any engine: it evaluates only the run's
newest committed checkpoint, once; an older checkpoint's trigger finds the newest already evaluated and skips; a
preset with eval.on_checkpoint off never evaluates on a checkpoint; a run whose campaign is running is left alone
unless eval.while_training. Real Prefect (test harness), a run directory with committed checkpoints, no engines."""

import json
from pathlib import Path

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.states import Completed, Running

from rstar2.core import checkpoint, config
from rstar2.core.layout import RunLayout
from rstar2.flows.evaluate import EvalParams, campaign_running, evaluate
from rstar2.run import runstate


@pytest.fixture()
def run(tmp_path) -> Path:
    """A campaign's run directory: its config.json and two committed checkpoints of stage1."""
    cfg = config.load("tiny", [f"out_dir={tmp_path}"])
    d = runstate.layout(cfg, "r").top
    d.mkdir(parents=True)
    (d / "config.json").write_text(cfg.model_dump_json())
    for step in (1, 2):
        checkpoint.commit(RunLayout.at(d).checkpoints(cfg.stages[0].name) / f"step-{step}",
                          lambda tmp: (tmp / "w").write_text("x"), {"global_step": step})
    return d


def _evaluated(run: Path, step: int) -> None:
    """What the evaluate task leaves behind for a checkpoint it evaluated."""
    (run / "eval").mkdir(exist_ok=True)
    model = run / "checkpoints" / "stage1" / f"step-{step}"
    (run / "eval" / f"stage1-step-{step}-test.json").write_text(json.dumps({"model_dir": str(model), "result": {}}))


def test_newest_and_evaluated_are_read_from_the_run_directory(run):
    cfg = config.load(str(run / "config.json"))
    assert runstate.newest_checkpoint(RunLayout.at(run), cfg) == run / "checkpoints" / "stage1" / "step-2"
    assert not runstate.evaluated(RunLayout.at(run), run / "checkpoints" / "stage1" / "step-2", "test")
    _evaluated(run, 2)
    assert runstate.evaluated(RunLayout.at(run), run / "checkpoints" / "stage1" / "step-2", "test")
    assert not runstate.evaluated(RunLayout.at(run), run / "checkpoints" / "stage1" / "step-2", "val")


def test_an_older_checkpoint_trigger_skips_once_the_newest_is_evaluated(run):
    _evaluated(run, 2)
    for trigger in ("checkpoint", "nightly"):
        out = evaluate(EvalParams(run_dir=str(run), run_name="r", trigger=trigger,
                                  checkpoint=str(run / "checkpoints" / "stage1" / "step-1")))
        assert "already evaluated" in out["skipped"]


def test_on_checkpoint_off_never_evaluates(run):
    out = evaluate(EvalParams(run_dir=str(run), trigger="checkpoint", overrides=["eval.on_checkpoint=false"]))
    assert "eval.on_checkpoint is off" in out["skipped"]


@flow(name="campaign")
def _campaign_stand_in(params: dict) -> None:
    """Only its name matters: a flow run of `campaign` registered in the API, in a state we set."""


def test_a_running_campaign_is_left_alone_unless_the_preset_allows(run):
    cfg = config.load(str(run / "config.json"))
    params = {"params": {"preset": str(run / "config.json"), "run_name": "r"}}
    with get_client(sync_client=True) as client:
        fr = client.create_flow_run(_campaign_stand_in, parameters=params, state=Running())
        assert runstate.layout(cfg, "r").top == run and campaign_running(RunLayout.at(run))
        out = evaluate(EvalParams(run_dir=str(run), trigger="checkpoint"))
        assert "still running" in out["skipped"]
        client.set_flow_run_state(fr.id, Completed(), force=True)
    assert not campaign_running(RunLayout.at(run))
