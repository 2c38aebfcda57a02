"""One RL step as a DAG the Prefect UI draws:
rollout -> score -> sandbox-execution-stats / roc-filter -> batch-metrics / grpo-update -> checkpoint -> evaluate.

The step is a task run (`<stage>-step-<n>`) in its stage's flow run, and the step's tasks are nested in it: the UI draws
each step as a box that opens to its DAG. A task run costs a few milliseconds of client time, a subflow ~6 blocking
Prefect API calls (bench/README.md, "Orchestration cost of an RL step")."""

from __future__ import annotations

from prefect import task
from pydantic import BaseModel

from rstar2.run.config import RunCfg, StageCfg
from rstar2.run.layout import RunRef
from rstar2.flows.evaluate import evaluate_loaded
from rstar2.tasks import rl


class StepAt(BaseModel):
    """Which step: `step` of `stage` (0-based within the stage), `global_step` over the run's stages."""
    stage: StageCfg
    step: int
    global_step: int


@task(name="rl-step", task_run_name="{at.stage.name}-step-{at.step}", cache_policy=None)
def rl_step(cfg: RunCfg, run: RunRef, at: StepAt, problems_uri: str) -> dict:
    """The step's metrics and its checkpoint; the caller logs them (rstar2.tasks.track.log_step)."""
    stage, step, global_step = at.stage, at.step, at.global_step
    rolled = rl.rollout(run, cfg, stage, step, problems_uri)
    scored = rl.score(run, rolled, cfg.sandbox)
    sandbox = rl.sandbox_stats(scored, rolled)
    kept = rl.roc_filter(scored, cfg.roc, cfg.rollout_for(stage).group_size, cfg.rl_seed * 100_003 + global_step)
    batch = rl.batch_metrics(scored, kept)
    update = rl.grpo_update(run, kept)
    meta = {"run": run.layout.root.name, "preset": cfg.name, "stage": stage.name, "step": step + 1,
            "global_step": global_step + 1}
    ckpt = rl.checkpoint(run, {"rollout": rolled, "batch": batch, "sandbox": sandbox, "roc": kept, "update": update},
                         str(run.layout.checkpoint(stage.name, step + 1)), meta, cfg.checkpoint.keep_last)
    rl.trajectory_samples(scored, f"{stage.name}-trajectories".replace("_", "-"), cfg.rl_seed + global_step)
    metrics = rl.step_figures({"rollout": rolled, "batch": batch, "sandbox": sandbox, "roc": kept, "update": update})
    if eval_due(cfg, step + 1):
        metrics.update(step_eval(cfg, run, stage, ckpt, meta))
    return {"checkpoint": ckpt, **metrics}


MODEL_META = ("run", "preset", "stage", "step", "global_step")  # what a step's checkpoint tells MLflow of itself


def eval_due(cfg: RunCfg, step: int) -> bool:
    """Whether step `step` (1-based within its stage) ends with an evaluation (eval.every)."""
    return bool(cfg.eval.every) and step % cfg.eval.every == 0


def step_eval(cfg: RunCfg, run: RunRef, stage: StageCfg, ckpt: str, meta: dict) -> dict:
    """The evaluation after a step (its checkpoint `ckpt` in the engines, `meta` its MODEL_META) as eval_<figure>
    step figures; with eval.suites, the first suite's."""
    ev = evaluate_loaded(cfg, run, rl.ModelRef(dir=ckpt, meta=meta, step=meta["global_step"]), cfg.eval.split,
                         str(run.layout.step_eval(stage.name, meta["step"] - 1)))
    return {f"eval_{k}": v for k, v in ev.items() if k != "suites"}
