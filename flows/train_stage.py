"""One RL stage: loops the RL step flow until the stage's curve plateaus or its budget is spent (rstar2/transition.py),
resuming after the stage's last committed checkpoint, then commits the stage's end record with its decision."""

from __future__ import annotations

import time
from pathlib import Path

from prefect import flow
from prefect.artifacts import (create_link_artifact, create_progress_artifact, create_table_artifact,
                               update_progress_artifact)

from rstar2 import checkpoint, runstate, tracking, transition
from rstar2.config import RunCfg, StageCfg
from flows.rl_step import rl_step
from tasks import rl

TABLE = ("reward_mean", "pass1_train", "tool_error_rate_pos", "format_violation_rate", "response_len_mean", "entropy",
         "roc_kept", "step_s")


def _key(stage: StageCfg, what: str) -> str:
    return f"{stage.name}-{what}".replace("_", "-").lower()  # artifact keys: lowercase, dashes


@flow(name="train-stage", flow_run_name="{stage.name}")
def train_stage(cfg: RunCfg, stage: StageCfg, actors: dict, world: dict, run_dir: str, experiment_id: str,
                parent_run_id: str, global_step0: int, problems_uri: str) -> dict:
    run = Path(run_dir)
    if done := runstate.finished(run, stage):
        return done
    metric = stage.plateau.metric if stage.plateau else "reward_mean"
    committed = checkpoint.committed(runstate.stage_ckpts(run, stage))  # steps this stage already finished
    rows = [{"step": checkpoint.manifest(d)["step"], **checkpoint.manifest(d).get("metrics", {})} for d in committed]
    tags = {"stage": stage.name, **({"ablation": cfg.ablation} if cfg.ablation else {})}
    run_id = tracking.find_or_create_run(experiment_id, f"stage-{stage.name}", f"{run}#{stage.name}", parent_run_id,
                                         tags)
    tracking.log_params(run_id, stage.model_dump())
    create_link_artifact(tracking.ui_url(experiment_id, run_id), link_text=f"MLflow: stage {stage.name}",
                         key=_key(stage, "mlflow"))
    step = len(rows)
    progress = create_progress_artifact(step / max(1, stage.steps) * 100, key=_key(stage, "progress"),
                                        description=f"stage {stage.name}: steps done of its budget {stage.steps}")
    history = lambda: [r[metric] for r in rows if r.get(metric) is not None]  # noqa: E731
    decision = transition.decide(history(), step, stage.steps, stage.plateau)
    while not decision.advance:
        t0 = time.perf_counter()
        res = rl_step(cfg, stage, step, global_step0 + step, actors, world, run_dir, experiment_id, run_id,
                      problems_uri)
        res["step_s"] = time.perf_counter() - t0
        step += 1
        rows.append({"step": step, **{k: v for k, v in res.items() if k != "checkpoint"}})
        tracking.log_metrics(run_id, {"step_s": res["step_s"]}, global_step0 + step)
        tracking.log_metrics(parent_run_id, {k: res[k] for k in ("reward_mean", "tool_error_rate_pos") if k in res},
                             global_step0 + step)
        update_progress_artifact(progress, step / stage.steps * 100)
        create_table_artifact([{k: round(r[k], 4) if isinstance(r.get(k), float) else r.get(k) for k in
                                ("step",) + TABLE} for r in rows], key=_key(stage, "metrics"),
                              description=f"stage {stage.name}: per-step metrics")
        rl.health_check(rows, global_step0, stage.name, run_id)  # the health line; the collapse alert in MLflow
        decision = transition.decide(history(), step, stage.steps, stage.plateau)
    final = checkpoint.latest(runstate.stage_ckpts(run, stage))
    record = {"stage": stage.name, "decision": decision.to_dict(), "steps": step,
              "global_step": global_step0 + step, "final_checkpoint": str(final) if final else None}
    tracking.client().set_tag(run_id, "end_reason", decision.reason)
    tracking.client().log_dict(run_id, record, "stage_end.json")
    runstate.mark_finished(run, stage, record)
    tracking.end(run_id)
    return record
