"""Hard-sample mining (paper §4.4): k rollouts per training problem with a checkpoint, drop the ones solved k/k, write
the hard set as Parquet with its lineage, log it to MLflow as a dataset. Runs inside a campaign before a `data: hard`
stage, or on its own from the UI (deployment `mine-hard`) for any committed checkpoint."""

from __future__ import annotations

from prefect import flow
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel

from rstar2.core import config
from rstar2.core.config import RunCfg
from rstar2.core.layout import RunRef
from rstar2.run import runstate
from rstar2.tasks import rl, track
from rstar2.tasks.run import run_context


class MineParams(BaseModel):
    """The run form: which run and stage to mine for, and optionally which checkpoint (default: the stage's start)."""
    preset: str = "tiny-stages"
    overrides: list[str] = []
    run_name: str | None = None
    stage: str = "stage3-hard"
    checkpoint: str | None = None


@flow(name="mine-hard-set", flow_run_name="{stage_name}")
def mine_hard_set(cfg: RunCfg, run: RunRef, stage_name: str, checkpoint_dir: str) -> dict:
    """The hard set for `stage_name` mined with `checkpoint_dir`, logged as a dataset of the run's MLflow run."""
    stage = next(s for s in cfg.stages if s.name == stage_name)
    lineage = rl.mine_hard(run, cfg, stage, checkpoint_dir)
    track.log_dataset(run.mlflow_run_id, lineage["hard_uri"], f"hard-{stage_name}", "training", lineage)
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
    run = runstate.layout(cfg, params.run_name)
    index = [s.name for s in cfg.stages].index(params.stage) if params.stage in [s.name for s in cfg.stages] else None
    if index is None:
        raise ValueError(f"preset {params.preset!r} has no stage {params.stage!r}: {[s.name for s in cfg.stages]}")
    ckpt = params.checkpoint or runstate.stage_start(run, cfg, index, runstate.sft_model(run, cfg))[0]
    with run_context(cfg, run, f"{run.name}-mine", {"kind": "campaign", "preset": params.preset}) as ref:
        rl.start_actors(ref, cfg, ckpt, with_trainer=False)
        return mine_hard_set(cfg, ref, params.stage, ckpt)
