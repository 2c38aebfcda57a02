"""Hard-sample mining (paper §4.4): k rollouts per training problem with a checkpoint, drop the ones solved k/k, write
the hard set as Parquet with its lineage, log it to MLflow as a dataset. Runs inside a campaign before a `data: hard`
stage, or on its own from the UI (deployment `mine-hard`) for any committed checkpoint."""

from __future__ import annotations

from pathlib import Path

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel

from rstar2 import config, runstate
from rstar2.config import RunCfg
from rstar2.controller import Controller
from tasks import rl, track
from tasks.run import run_context


class MineParams(BaseModel):
    """The run form: which run and stage to mine for, and optionally which checkpoint (default: the stage's start)."""
    preset: str = "tiny-stages"
    overrides: list[str] = []
    run_name: str | None = None
    stage: str = "stage3-hard"
    checkpoint: str | None = None


@flow(name="mine-hard-set", flow_run_name="{stage_name}")
def mine_hard_set(cfg: RunCfg, stage_name: str, ctl: Controller, world: dict, run_dir: str, experiment_id: str,
                  campaign_run_id: str, checkpoint_dir: str) -> dict:
    stage = next(s for s in cfg.stages if s.name == stage_name)
    out = Path(run_dir) / "mining" / stage_name / Path(checkpoint_dir).name
    lineage = rl.mine_hard(ctl, checkpoint_dir, world["train"], cfg.mining, cfg.rollout_for(stage), cfg.sandbox,
                           cfg.world.max_positions, str(out), cfg.rl_seed, cfg.scheduler)
    track.log_dataset(campaign_run_id, lineage["hard_uri"], f"hard-{stage_name}", "training", lineage)
    create_markdown_artifact(
        f"**hard set for {stage_name}** from `{checkpoint_dir}` (k={lineage['k']})\n\n| problems | count |\n|---|---|\n"
        f"| mined | {lineage['problems_before']} |\n| solved k/k (dropped) | {lineage['solved_all']} |\n"
        f"| solved 0/k | {lineage['solved_none']} |\n| hard set | {lineage['problems_after']} |\n",
        key=f"{stage_name}-hard-set".replace("_", "-").lower())
    return lineage


@flow(name="mine-hard", flow_run_name="{params.stage}")
def mine_hard(params: MineParams = MineParams()) -> dict:
    """Deployment entry: mine on its own, with its own engine (the campaign's actors are not needed)."""
    cfg = config.load(params.preset, params.overrides)
    run = runstate.run_dir(cfg, params.run_name)
    index = [s.name for s in cfg.stages].index(params.stage) if params.stage in [s.name for s in cfg.stages] else None
    if index is None:
        raise ValueError(f"preset {params.preset!r} has no stage {params.stage!r}: {[s.name for s in cfg.stages]}")
    ckpt = params.checkpoint or runstate.stage_start(run, cfg, index, runstate.sft_model(run, cfg))[0]
    with run_context(cfg, run, f"{run.name}-mine", {"kind": "campaign", "preset": params.preset}) as ctx:
        rl.start_actors(ctx.ctl, cfg, ckpt, with_trainer=False)
        return mine_hard_set(cfg, params.stage, ctx.ctl, ctx.world, str(run), ctx.experiment_id, ctx.mlflow_run_id,
                             ckpt)
