"""The overlapping step's bookkeeping (rollout.max_staleness): which weights each step's rollout samples with, its
lag behind the trainer, and the settings such a run needs. Reference values worked by hand: with a lag of 1, step s of
a stage samples from the checkpoint of step s-1 (1-based names: after s-1 updates in the stage), the first two from
the stage's start."""

import pytest

from rstar2.core import config
from rstar2.core.layout import RunLayout, RunRef
from rstar2.flows.rl_step import policy, staleness
from rstar2.flows.stage_transition import StageStart
from rstar2.tasks.rl import StepAt


def _at(cfg, step: int, global0: int = 5) -> StepAt:
    return StepAt(stage=cfg.stages[0], step=step, global_step=global0 + step)


@pytest.fixture
def run(tmp_path) -> RunRef:
    return RunRef(layout=RunLayout.of(tmp_path, "r"), world=None, experiment_id="0", mlflow_run_id="m",
                  controller_id="c")


def test_the_synchronous_step_samples_from_whatever_the_engines_hold(run):
    cfg = config.load("tiny")
    start = StageStart(problems_uri="p", start_model="/sft", global_step0=5)
    for step in (0, 3):
        assert staleness(cfg, _at(cfg, step)) == 0
        got = policy(cfg, run, _at(cfg, step), start)
        assert got.model_dir is None and got.version == 5 + step


def test_one_step_behind_from_the_second_step_of_a_stage(run):
    cfg = config.load("tiny", ["rollout.max_staleness=1", "trainer.tis_cap=2"])
    stage = cfg.stages[0].name
    start = StageStart(problems_uri="p", start_model="/sft", global_step0=5)
    got = {s: policy(cfg, run, _at(cfg, s), start) for s in range(4)}
    assert [staleness(cfg, _at(cfg, s)) for s in range(4)] == [0, 1, 1, 1]
    assert [got[s].version for s in range(4)] == [5, 5, 6, 7]
    assert [got[s].model_dir for s in range(4)] == ["/sft", "/sft", str(run.layout.checkpoint(stage, 1)),
                                                    str(run.layout.checkpoint(stage, 2))]


@pytest.mark.parametrize("sets, says", [
    (["rollout.max_staleness=1"], "trainer.tis_cap"),
    (["rollout.max_staleness=1", "trainer.tis_cap=2", "checkpoint.keep_last=1"], "checkpoint.keep_last"),
    (["rollout.max_staleness=1", "trainer.tis_cap=2", "placement.colocate=true"], "placement.colocate"),
    (["rollout.max_staleness=2", "trainer.tis_cap=2"], "max_staleness"),
    (["rollout.partial=true"], "rollout.partial needs trainer.tis_cap"),
    (["rollout.partial=true", "trainer.tis_cap=2", "rollout.partial_extra=0"], "partial_extra"),
])
def test_a_run_that_cannot_overlap_or_cut_is_refused_naming_the_setting(sets, says):
    with pytest.raises(ValueError, match=says):
        config.load("tiny", sets)
