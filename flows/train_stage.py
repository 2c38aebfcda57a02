"""One RL stage: loops the RL step flow, resuming after the last committed checkpoint of the stage."""

from __future__ import annotations

import time
from pathlib import Path

from prefect import flow
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact

from rstar2 import checkpoint, tracking
from rstar2.config import RunCfg, StageCfg
from flows.rl_step import rl_step
from tasks import rl


@flow(name="train-stage", flow_run_name="{stage.name}")
def train_stage(cfg: RunCfg, stage: StageCfg, actors: dict, world: dict, run_dir: str, experiment_id: str,
                parent_run_id: str, global_step0: int, problems_uri: str) -> dict:
    ckpts = Path(run_dir) / "checkpoints" / stage.name
    last = checkpoint.latest(ckpts)
    start = checkpoint.manifest(last)["step"] if last else 0
    run_id = tracking.create_run(experiment_id, f"stage-{stage.name}", parent_run_id, {"stage": stage.name})
    tracking.log_params(run_id, stage.model_dump())
    if last:  # a retried or restarted stage resumes the trainer's full state from its last committed step
        rl.resume(actors, str(last))
    progress = create_progress_artifact(start / max(1, stage.steps) * 100, key=f"{stage.name}-progress".replace("_", "-"),
                                        description=f"stage {stage.name}")
    rows, step_result = [], {}
    for step in range(start, stage.steps):
        t0 = time.perf_counter()
        step_result = rl_step(cfg, stage, step, global_step0 + step, actors, world, run_dir, run_id, problems_uri)
        step_result["step_s"] = time.perf_counter() - t0
        tracking.log_metrics(run_id, {"step_s": step_result["step_s"]}, step=global_step0 + step + 1)
        tracking.log_metrics(parent_run_id, {k: step_result[k] for k in ("reward_mean", "tool_error_rate_pos")},
                             step=global_step0 + step + 1)
        rows.append({"step": step + 1, **{k: round(step_result[k], 4) for k in (
            "reward_mean", "tool_error_rate_pos", "format_violation_rate", "response_len_mean", "roc_kept",
            "step_s")}})
        update_progress_artifact(progress, (step + 1) / stage.steps * 100)
    if rows:
        create_table_artifact(rows, key=f"{stage.name}-metrics".replace("_", "-"), description="per-step metrics")
    tracking.end(run_id)
    final = checkpoint.latest(ckpts)
    return {"checkpoint": str(final) if final else None, "steps": stage.steps, "last": step_result}
