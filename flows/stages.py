"""Entry flows for one piece of a campaign, so each can be triggered and retried on its own from the Prefect UI:
`sft` (world + SFT) and `run-stage` (one RL stage of a run, after the stages before it). The campaign composes the same
subflows; all of them resume from the run directory's committed state."""

from __future__ import annotations

from pathlib import Path

from prefect import flow
from pydantic import BaseModel

from rstar2.core import checkpoint, config
from rstar2.flows.stage_transition import stage_transition
from rstar2.flows.train_stage import train_stage
from rstar2.run import runstate
from rstar2.tasks import rl
from rstar2.tasks.run import run_context
from rstar2.tasks.world import build_world, run_sft


class RunParams(BaseModel):
    """The run form: a preset, overrides, and the run directory name (default: the preset's name)."""
    preset: str = "tiny"
    overrides: list[str] = []
    run_name: str | None = None


class StageParams(RunParams):
    stage: str = "stage1"


@flow(name="sft", flow_run_name="{params.preset}")
def sft(params: RunParams = RunParams()) -> str:
    cfg = config.load(params.preset, params.overrides)
    run = runstate.layout(cfg, params.run_name)
    world = build_world(cfg, str(run.world))
    return run_sft(cfg, world["init_model"], world["sft_data"], str(run.sft))


@flow(name="run-stage", flow_run_name="{params.stage}")
def run_stage(params: StageParams = StageParams()) -> dict:
    cfg = config.load(params.preset, params.overrides)
    names = [s.name for s in cfg.stages]
    if params.stage not in names:
        raise ValueError(f"preset {params.preset!r} has no stage {params.stage!r}; its stages: {names}")
    index = names.index(params.stage)
    run = runstate.layout(cfg, params.run_name)
    unfinished = [s.name for s in cfg.stages[:index] if runstate.finished(run, s) is None]
    if unfinished:
        raise ValueError(f"stage {params.stage!r} starts after {unfinished}, which have not finished in {run.root}")
    sft_model = runstate.sft_model(run, cfg)
    resume, is_rl = runstate.resume_point(run, cfg, sft_model, upto=index)
    if not is_rl and cfg.sft.enabled and not checkpoint.is_committed(Path(sft_model)):
        raise ValueError(f"{sft_model} is not a committed SFT model: run the `sft` flow first, or set "
                         f"sft.enabled=false to start RL from the initial model")
    with run_context(cfg, run, run.name, {"kind": "campaign", "preset": params.preset}) as ref:
        rl.start_actors(ref, cfg, resume)
        if is_rl:
            rl.restore_trainer(ref, resume)
        start = stage_transition(cfg, ref, params.stage, sft_model)
        return train_stage(cfg, ref, cfg.stages[index], start)
