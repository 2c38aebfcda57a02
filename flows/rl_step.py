"""One RL step as a DAG the Prefect UI draws:
rollout -> score -> sandbox-execution-stats / roc-filter -> batch-metrics / grpo-update -> checkpoint -> evaluate."""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from rstar2.config import RunCfg, StageCfg
from rstar2.controller import Controller
from flows.evaluate import evaluate_loaded
from tasks import rl


# validate_parameters off: the stage flow passes the typed objects it was itself given (validated once, there);
# pydantic would re-validate the whole run config at every step
@flow(name="rl-step", flow_run_name="{stage.name}-step-{step}", validate_parameters=False)
def rl_step(cfg: RunCfg, stage: StageCfg, step: int, global_step: int, ctl: Controller, world: dict, run_dir: str,
            experiment_id: str, mlflow_run_id: str, problems_uri: str) -> dict:
    """The step's metrics and its checkpoint; the caller logs them (tasks.track.log_step)."""
    d = Path(run_dir) / stage.name / f"step-{step:04d}"
    limits = cfg.rollout_for(stage)
    samples = limits.group_size * (limits.oversample if cfg.roc.enabled else 1)
    rolled = rl.rollout(ctl, world["init_model"], problems_uri, step, stage.prompts_per_step, samples, limits,
                        cfg.sandbox, cfg.rl_seed, cfg.world.max_positions, str(d / "rollouts.parquet"), cfg.scheduler,
                        cfg.trainer.engine_logprobs)
    scored = rl.score(ctl, rolled["uri"], cfg.sandbox, str(d / "scored.parquet"))
    sandbox = rl.sandbox_stats(scored)
    kept = rl.roc_filter(scored, cfg.roc, limits.group_size, cfg.rl_seed * 100_003 + global_step,
                         str(d / "kept.parquet"))
    batch = rl.batch_metrics(scored, kept)
    update = rl.grpo_update(ctl, kept)
    meta = {"run": Path(run_dir).name, "preset": cfg.name, "stage": stage.name, "step": step + 1,
            "global_step": global_step + 1}
    ckpt = rl.checkpoint(ctl, update, batch, sandbox, str(Path(run_dir) / "checkpoints" / stage.name /
                                                          f"step-{step + 1:04d}"), meta, experiment_id, mlflow_run_id,
                         cfg.checkpoint.keep_last)
    rl.trajectory_samples(scored, f"{stage.name}-trajectories".replace("_", "-"), cfg.rl_seed + global_step)
    metrics = {**{k: v for k, v in rolled.items() if k != "uri"}, **batch, **sandbox,
               **{k: v for k, v in kept.items() if k != "uri"}, **update}
    if cfg.eval.every and (step + 1) % cfg.eval.every == 0:
        ev = evaluate_loaded(cfg, ctl, world, ckpt, run_dir, experiment_id, mlflow_run_id,
                             f"{stage.name}-step-{step + 1:04d}", cfg.eval.split, global_step + 1, meta,
                             str(d / "eval"))
        metrics.update({f"eval_{k}": v for k, v in ev.items() if k != "suites"})  # with suites: the first suite's
    return {"checkpoint": ckpt, **metrics}
