"""One RL step as a DAG the Prefect UI draws:
rollout -> score -> sandbox-execution-stats / roc-filter -> batch-metrics / grpo-update -> checkpoint -> evaluate.

The step is a task run (`<stage>-step-<n>`) in its stage's flow run, and the step's tasks are nested in it: the UI draws
each step as a box that opens to its DAG. A task run costs a few milliseconds of client time, a subflow ~6 blocking
Prefect API calls (bench/README.md, "Orchestration cost of an RL step").

With rollout.max_staleness 1 the next step's rollout runs beside this step's scoring and update, on the weights the
engines hold (one version behind the trainer's once the update lands); the checkpoint waits for it, so the new
weights reach the engines between two rollouts, and the next step starts from its table.

With rollout.partial the rollout ends once the step's quota of groups is complete, and hands the rest on to the next
step's rollout (rstar2.rollout.partial); the update's lag is then that of the table's oldest turn."""

from __future__ import annotations

from prefect import task

from rstar2.core.config import RunCfg, StageCfg
from rstar2.core.layout import RunRef
from rstar2.flows.evaluate import evaluate_loaded
from rstar2.flows.stage_transition import StageStart
from rstar2.tasks import rl
from rstar2.tasks.rl import Policy, StepAt


@task(name="rl-step", task_run_name="{at.stage.name}-step-{at.step}", cache_policy=None)
def rl_step(cfg: RunCfg, run: RunRef, at: StepAt, start: StageStart, rolled: dict | None = None) -> dict:
    """The step's metrics and its checkpoint; the caller logs them (rstar2.tasks.track.log_step). `rolled`: this
    step's rollout when the step before made it (overlap); the result's "ahead" is the next step's, or None."""
    stage, step, global_step = at.stage, at.step, at.global_step
    rolled = rolled or rl.rollout(run, cfg, at, start.problems_uri, policy(cfg, run, at, start))
    lag = rolled.get("partial_staleness", staleness(cfg, at))  # partial: carried turns are older
    ahead = None
    if cfg.rollout.max_staleness and step + 1 < stage.steps:  # the next step's rollout, beside this update
        nxt = at.model_copy(update={"step": step + 1, "global_step": global_step + 1})
        ahead = rl.rollout.submit(run, cfg, nxt, start.problems_uri, policy(cfg, run, nxt, start))
    scored = rl.score(run, rolled, cfg.sandbox)
    sandbox = rl.sandbox_stats(scored, rolled)
    kept = rl.roc_filter(scored, cfg.roc, cfg.rollout_for(stage).group_size, cfg.rl_seed * 100_003 + global_step)
    batch = rl.batch_metrics(scored, kept)
    update = rl.grpo_update(run, kept, lag)
    ahead = ahead.result() if ahead is not None else None  # before the commit: a resumed run never has half of it
    meta = {"run": run.layout.root.name, "preset": cfg.name, "stage": stage.name, "step": step + 1,
            "global_step": global_step + 1}
    parts = {"rollout": rolled, "batch": batch, "sandbox": sandbox, "roc": kept, "update": update,
             "lag": {"staleness": float(lag)}}
    committed = rl.checkpoint(run, parts, str(run.layout.checkpoint(stage.name, step + 1)), meta,
                              cfg.checkpoint.keep_last)
    ckpt = committed["path"]
    rl.trajectory_samples(scored, f"{stage.name}-trajectories".replace("_", "-"), cfg.rl_seed + global_step)
    metrics = {**rl.step_figures(parts), **{k: v for k, v in committed.items() if k != "path"}}
    if eval_due(cfg, step + 1):
        metrics.update(step_eval(cfg, run, stage, ckpt, meta))
    return {"checkpoint": ckpt, "ahead": ahead, **metrics}


def staleness(cfg: RunCfg, at: StepAt) -> int:
    """Updates between the weights that sample step `at`'s rollout and the trainer's at its update: the stage's first
    steps sample from its start, as the trainer does."""
    return min(at.step, cfg.rollout.max_staleness)


def policy(cfg: RunCfg, run: RunRef, at: StepAt, start: StageStart) -> rl.Policy:
    """The weights step `at`'s rollout samples with. Synchronous: the engines' (the newest, synced by the step
    before). Overlapping: the checkpoint `staleness` steps back, or the stage's start model; the engines hold it
    already, except in a resumed run, where the rollout task loads it."""
    lag = staleness(cfg, at)
    version = at.global_step - lag
    if not cfg.rollout.max_staleness:
        return Policy(version=version)
    back = at.step - lag
    return Policy(model_dir=str(run.layout.checkpoint(at.stage.name, back)) if back else start.start_model,
                  version=version)


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
