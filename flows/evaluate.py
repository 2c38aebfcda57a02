"""Evaluation (paper §5.1 protocol, sizes from config): pass@1 averaged over k samples at temperature T, with the
length and turn limits of `eval`, on the held-out split; the result is attached to the checkpoint's MLflow LoggedModel.

Inside a campaign it reuses the campaign's engines; as a deployment (`evaluate`: a cron schedule, and a trigger on the
`rstar2.checkpoint.committed` event) it starts its own engine, and its concurrency limit of 1 keeps evaluations from
piling up."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from prefect import flow
from pydantic import BaseModel

from rstar2 import checkpoint, config, runstate, tracking
from rstar2.config import RunCfg
from rstar2.world.build import eval_split
from tasks import rl
from tasks.world import build_world


class EvalParams(BaseModel):
    """The run form: which run's checkpoint to evaluate (default: the run's newest committed checkpoint)."""
    preset: str = "tiny"
    overrides: list[str] = []
    run_name: str | None = None
    checkpoint: str | None = None
    split: Literal["test", "val"] | None = None  # default: the preset's eval.split


def result_name(model_dir: str, split: str) -> str:
    p = Path(model_dir)
    return f"{p.parent.name}-{p.name}-{split}" if p.name.startswith("step-") else f"{p.name}-{split}"


@flow(name="evaluate-checkpoint", flow_run_name="{name}")
def evaluate_checkpoint(cfg: RunCfg, actors: dict, world: dict, model_dir: str, run_dir: str, experiment_id: str,
                        mlflow_run_id: str, name: str, split: str, step: int) -> dict:
    """Evaluate `model_dir` with the given engines (they are loaded with it first) and record it in MLflow."""
    rl.load_weights(actors, model_dir)
    result = rl.evaluate(actors, model_dir, eval_split(world, split), cfg.eval, cfg.world.max_positions, cfg.sandbox,
                         str(Path(run_dir) / "eval" / f"{name}.parquet"))
    meta = checkpoint.manifest(Path(model_dir)) if checkpoint.is_committed(Path(model_dir)) else {"stage": name}
    rl.log_evaluation(result, experiment_id, mlflow_run_id, model_dir,
                      {k: v for k, v in meta.items() if k not in ("metrics", "files")}, step, split)
    return result


@flow(name="evaluate", flow_run_name="{params.run_name}")
def evaluate(params: EvalParams = EvalParams()) -> dict:
    """Deployment entry: evaluate one checkpoint of a run with a fresh engine."""
    cfg = config.load(params.preset, params.overrides)
    run = runstate.run_dir(cfg, params.run_name)
    model_dir = params.checkpoint or runstate.resume_point(run, cfg, str(run / "sft"))[0]
    if not checkpoint.is_committed(Path(model_dir)):
        raise ValueError(f"{model_dir} is not a committed checkpoint; nothing to evaluate")
    split = params.split or cfg.eval.split
    world = build_world(cfg, str(run / "world"))
    exp_id = tracking.setup(cfg.experiment, cfg.out_dir)
    run_id = tracking.find_or_create_run(exp_id, run.name, str(run), tags={"kind": "campaign", "preset": params.preset})
    actors = rl.start_actors(f"{run.name}-eval", cfg, model_dir, with_trainer=False)
    try:
        step = checkpoint.manifest(Path(model_dir)).get("global_step", 0)
        return evaluate_checkpoint(cfg, actors, world, model_dir, str(run), exp_id, run_id,
                                   result_name(model_dir, split), split, step)
    finally:
        rl.stop_actors(actors)
