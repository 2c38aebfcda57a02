"""One RL stage: loops the RL step flow until the stage's curve plateaus or its budget is spent
(rstar2/training/transition.py), resuming after the stage's last committed checkpoint, then commits the stage's end
record with its decision."""

from __future__ import annotations

import time

from prefect import flow
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact

from rstar2.core import checkpoint
from rstar2.core.config import RunCfg, StageCfg
from rstar2.core.layout import RunRef
from rstar2.flows.rl_step import MODEL_META, eval_due, rl_step, step_eval
from rstar2.flows.stage_transition import StageStart
from rstar2.run import runstate
from rstar2.tasks import costs, publish, rl, track
from rstar2.tasks.rl import StepAt
from rstar2.training import transition

TABLE = ("reward_mean", "pass1_train", "tool_error_rate_pos", "format_violation_rate", "response_len_mean", "entropy",
         "roc_kept", "step_s")


def _key(stage: StageCfg, what: str) -> str:
    return f"{stage.name}-{what}".replace("_", "-").lower()  # artifact keys: lowercase, dashes


def _progress_line(stage: StageCfg, row: dict) -> str:
    """The progress artifact's caption: steps done of the budget and the last step's headline figures (the whole
    table is the stage's metrics artifact, written when it ends; every step's figures are in MLflow)."""
    figures = " | ".join(f"{k} {row[k]:.3g}" for k in TABLE if isinstance(row.get(k), float))
    return f"stage {stage.name}: step {row['step']} of its budget {stage.steps}" + (f" | {figures}" if figures else "")


def _redo_step_evals(cfg: RunCfg, run: RunRef, stage: StageCfg, rows: list[dict], committed: list) -> None:
    """A step that died after its commit, before its periodic evaluation (eval.every), gets it now, into its row (a
    plateau on eval_pass1 then sees what the run without the fault saw); the engines hold the last checkpoint again
    after it."""
    due = [(r, d) for r, d in zip(rows, committed) if eval_due(cfg, r["step"]) and "eval_pass1" not in r]
    for row, ckpt in due:
        manifest = checkpoint.manifest(ckpt)
        rl.load_weights(run, str(ckpt))
        row.update(step_eval(cfg, run, stage, str(ckpt), {k: manifest[k] for k in MODEL_META if k in manifest}))
    if due:
        rl.load_weights(run, str(committed[-1]))


@flow(name="train-stage", flow_run_name="{stage.name}")
def train_stage(cfg: RunCfg, run: RunRef, stage: StageCfg, start: StageStart) -> dict:
    """The stage from `start` (stage_transition's), its steps logged to a stage run under the run's MLflow run."""
    layout, global_step0 = run.layout, start.global_step0
    if done := runstate.finished(layout, stage):
        return done
    metric = stage.plateau.metric if stage.plateau else "reward_mean"
    checkpoint.sweep(layout.checkpoints(stage.name))  # what a killed run left half-written
    committed = runstate.committed_steps(layout, stage)  # steps this stage already finished
    rows = [{"step": checkpoint.manifest(d)["step"], **checkpoint.manifest(d).get("metrics", {})} for d in committed]
    tags = {"stage": stage.name, **({"ablation": cfg.ablation} if cfg.ablation else {})}
    _, run_id = track.open_run(track.RunSpec(
        experiment=cfg.experiment, out_dir=cfg.out_dir, name=f"stage-{stage.name}", key=f"{layout.root}#{stage.name}",
        parent_id=run.mlflow_run_id, tags=tags, params=stage.model_dump(), link_key=_key(stage, "mlflow")))
    _redo_step_evals(cfg, run.model_copy(update={"mlflow_run_id": run_id}), stage, rows, committed)
    track.log_unlogged_steps(rows, global_step0, stage.name, (run_id, run.mlflow_run_id))  # died after a commit
    step = len(rows)
    progress = create_progress_artifact(step / max(1, stage.steps) * 100, key=_key(stage, "progress"),
                                        description=_progress_line(stage, rows[-1] if rows else {"step": 0}))
    history = lambda: [r[metric] for r in rows if r.get(metric) is not None]  # noqa: E731
    decision = transition.decide(history(), step, stage.steps, stage.plateau)
    since = costs.mark()  # a step's orchestration cost is measured over its window (track.log_step)
    ahead = None  # the next step's rollout, made during this one (rollout.max_staleness); a resumed run makes it again
    while not decision.advance:
        res = rl_step(cfg, run.model_copy(update={"mlflow_run_id": run_id}),
                      StepAt(stage=stage, step=step, global_step=global_step0 + step), start, ahead)
        res["step_s"] = time.perf_counter() - since[0]
        step += 1
        ahead = res.pop("ahead")
        rows.append({"step": step, **{k: v for k, v in res.items() if k != "checkpoint"}})
        publish.later(update_progress_artifact, progress, step / stage.steps * 100, _progress_line(stage, rows[-1]))
        _, since = track.log_step(rows, global_step0, stage.name, (run_id, run.mlflow_run_id), since)
        decision = transition.decide(history(), step, stage.steps, stage.plateau)
    publish.drain()  # the progress and trajectory artifacts before the stage's table
    if rows:
        create_table_artifact([{k: round(r[k], 4) if isinstance(r.get(k), float) else r.get(k) for k in
                                ("step",) + TABLE} for r in rows], key=_key(stage, "metrics"),
                              description=f"stage {stage.name}: per-step metrics")
    final = runstate.latest_step(layout, stage)
    record = {"stage": stage.name, "decision": decision.to_dict(), "steps": step,
              "global_step": global_step0 + step, "final_checkpoint": str(final) if final else None}
    track.log_record(run_id, record, "stage_end.json", {"end_reason": decision.reason})
    runstate.mark_finished(layout, stage, record)
    track.end_run(run_id)
    return record
