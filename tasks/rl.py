"""The RL step's tasks: rollout -> score -> sandbox stats -> RoC -> update -> checkpoint -> evaluate. Each takes the
run's reference (rstar2.core.layout.RunRef) and the config sections it uses; one that drives engines or the trainer
finds the run's Controller from the reference (rstar2.tasks.run.controller). Evaluation tables go to the
`rstar2.tasks.rl` logger (INFO): the terminal and the flow run's Prefect logs."""

import logging
import time
from pathlib import Path

import ray
from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.events import emit_event
from pydantic import BaseModel

from rstar2.core import checkpoint as ckpt
from rstar2.core import layout, progress, tracking
from rstar2.core.config import RoCCfg, RunCfg, SandboxCfg, StageCfg
from rstar2.core.layout import RunLayout, RunRef
from rstar2.core.progress import bar
from rstar2.evaluation import report
from rstar2.rollout import partial
from rstar2.rollout.partial import PartialRun
from rstar2.run import mining, runstate, steps
from rstar2.tasks import costs, publish
from rstar2.tasks.run import controller

log = logging.getLogger(__name__)


class ModelRef(BaseModel):
    """A model as MLflow records it: its directory, its manifest's fields (stage, step, run, ...) and its step."""
    dir: str
    meta: dict = {}
    step: int = 0


class EvalTable(BaseModel):
    """A problem table to evaluate on and how its answers are checked (math: Math-Verify; integer, choice: exact)."""
    uri: str
    answer_type: str = "math"


def _retry_transient(task, task_run, state) -> bool:
    """Retry engine/actor hiccups, never a bug in our own code."""
    try:
        state.result()
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, TimeoutError, ConnectionError):
        return True
    except Exception:
        return False
    return False


@task(name="start-actors", cache_policy=None)
@costs.work
def start_actors(run: RunRef, cfg: RunCfg, model_dir: str, with_trainer: bool = True) -> dict:
    """The run's engines (kept once started) and, unless `with_trainer` is off, its trainer, from `model_dir`."""
    ctl = controller(run)
    ctl.start(cfg, model_dir, with_trainer)
    return ctl.identity()


@task(name="restore-trainer", cache_policy=None)
@costs.work
def restore_trainer(run: RunRef, ckpt_dir: str) -> str:
    """A retried run: the trainer (started from the checkpoint's weights) takes back its optimizer/LR/RNG state."""
    controller(run).restore(ckpt_dir)
    return ckpt_dir


@task(name="restart-trainer", cache_policy=None)
@costs.work
def restart_trainer(run: RunRef, cfg: RunCfg, model_dir: str) -> dict:
    """The next RL seed: a new trainer from `model_dir` with seed cfg.rl_seed and a fresh optimizer (engines kept)."""
    ctl = controller(run)
    ctl.restart_trainer(cfg, model_dir)
    return ctl.identity()


class StepAt(BaseModel):
    """Which step: `step` of `stage` (0-based within the stage), `global_step` over the run's stages."""
    stage: StageCfg
    step: int
    global_step: int


class Policy(BaseModel):
    """The weights a rollout samples with: `model_dir` (None: whatever the engines hold, the synchronous step's
    newest weights) and `version`, the number of updates behind them over the run."""
    model_dir: str | None = None
    version: int


@task(name="rollout", cache_policy=None, retries=2, retry_condition_fn=_retry_transient)
@costs.work
def rollout(run: RunRef, cfg: RunCfg, at: StepAt, problems_uri: str, policy: Policy) -> dict:
    """Step `at`: its prompts from `problems_uri`, each sampled G times (2G with RoC's oversampling), through the
    scheduler (rstar2.rollout.scheduler) into the step's rollout table, every row marked with the policy's version:
    {"uri": the table, "sandbox": the service's figures over the rollout, scheduling metrics}. With
    trainer.engine_logprobs the engines record the log-prob of every sampled token (for trainer.old_logprobs=engine /
    tis_cap)."""
    stage, step = at.stage, at.step
    ctl, limits = controller(run), cfg.rollout_for(stage)
    if policy.model_dir:
        ctl.sync_weights(policy.model_dir)  # a resumed overlapping run: the engines go back one version
    samples = limits.group_size * (limits.oversample if cfg.roc.enabled else 1)
    out_uri = str(run.layout.step_table(stage.name, step, layout.ROLLOUTS))
    engines = ctl.engine_clients(limits.temperature, limits.top_p, cfg.trainer.engine_logprobs)
    part = None
    if limits.partial:
        problems, part = _partial_prompts(run, cfg, at, problems_uri)
    else:
        problems = steps.select_prompts(problems_uri, step, stage.prompts_per_step, cfg.rl_seed)
    with bar(f"rollout step {step + 1}") as progress:
        setup = steps.RolloutSetup(engines, cfg.scheduler, run.needs_world().init_model, ctl.sandbox(cfg.sandbox),
                                   cfg.world.max_positions, ctl.estimator)
        info = steps.rollout_to_parquet(setup, problems, samples, limits, out_uri, on_done=progress,
                                        seed=f"{cfg.rl_seed}/step{step}", policy_version=policy.version,
                                        partial_run=part)
    out = {"uri": out_uri, "sandbox": info["sandbox"],
           **{k: v for k, v in info.items() if k.startswith(("sched_", "rollout_", "partial_"))}}
    if part:  # updates between the table's oldest turn and the trainer's weights at this step's update
        out["partial_staleness"] = at.global_step - info["oldest_version"]
    return out


def _partial_prompts(run: RunRef, cfg: RunCfg, at: StepAt, problems_uri: str) -> tuple[list[dict], PartialRun]:
    """A partial rollout's new problems (the groups in flight topped up to the quota and its extra) and its inputs:
    the carry of the stage's step before (none at its first step)."""
    stage, step = at.stage, at.step
    carry = steps.read_carry(str(run.layout.step_table(stage.name, step - 1, layout.CARRY)) if step else None)
    quota = stage.prompts_per_step
    n_new = quota + partial.extra_groups(quota, cfg.rollout.partial_extra) - len(carry.problem_ids)
    problems, carry.cursor = steps.draw_prompts(problems_uri, carry.cursor, n_new, cfg.rl_seed, carry.problem_ids)
    return problems, PartialRun(carry, quota, str(run.layout.step_table(stage.name, step, layout.CARRY)))


@task(name="score", cache_policy=None)
@costs.work
def score(run: RunRef, rolled: dict, sandbox_cfg: SandboxCfg) -> dict:
    """The rollout's rewards and RoC penalties, next to it as scored.parquet: {"uri", "verify": the checks' figures}."""
    out_uri = str(RunLayout.beside(rolled["uri"], layout.SCORED))
    res = steps.score(rolled["uri"], controller(run).verifier(sandbox_cfg), out_uri)
    return {"uri": out_uri, "verify": res["verify"]}


@task(name="sandbox-execution-stats", cache_policy=None)
@costs.work
def sandbox_stats(scored: dict, rolled: dict) -> dict:
    return steps.sandbox_stats(scored["uri"], {**rolled["sandbox"], **scored["verify"]})


@task(name="roc-filter", cache_policy=None)
@costs.work
def roc_filter(scored: dict, roc: RoCCfg, group_size: int, seed: int) -> dict:
    """GRPO-RoC's 2G -> G per prompt (G = `group_size`, the stage's) into kept.parquet, drawn with `seed`."""
    out_uri = str(RunLayout.beside(scored["uri"], layout.KEPT))
    return {"uri": out_uri, **steps.roc_filter(scored["uri"], roc, group_size, seed, out_uri)}


@task(name="batch-metrics", cache_policy=None)
@costs.work
def batch_metrics(scored: dict, roc: dict) -> dict:
    return steps.batch_metrics(scored["uri"], roc["uri"])


@task(name="grpo-update", cache_policy=None)
@costs.work
def grpo_update(run: RunRef, roc: dict, staleness: int = 0) -> dict:
    """The update on RoC's kept batch, sampled `staleness` updates behind the trainer's weights."""
    return controller(run).update(roc["uri"], staleness)


def step_figures(parts: dict) -> dict:
    """A step's figures from its tasks' outputs ({"rollout", "batch", "sandbox", "roc", "update"}): every number
    but the tables' URIs and the sandbox's own record."""
    return {k: v for part in parts.values() for k, v in part.items() if k not in ("uri", "sandbox")}


@task(name="checkpoint", cache_policy=None)
@costs.work
def checkpoint(run: RunRef, figures: dict, ckpt_dir: str, meta: dict, keep_last: int | None = None) -> dict:
    """Commit the trainer state atomically (the step's figures, `step_figures(figures)`, sealed in its manifest: a
    resumed run logs from it a step whose process died after the commit), load the new weights into every engine in
    place (from the checkpoint or from the trainer's memory), delete the stage's checkpoints older than the newest
    `keep_last` (checkpoint.keep_last), record the checkpoint as an MLflow LoggedModel and announce it (evaluation
    deployments trigger on the event). Returns {"path", "sync_s": the engines' weight sync, and the collective
    sync's sync_bytes / sync_buckets / sync_shared}: step figures the manifest does not seal (made after it)."""
    ctl = controller(run)
    meta = {**meta, "metrics": step_figures(figures)}
    path = ctl.save(ckpt_dir, meta)
    t0 = time.perf_counter()
    ctl.sync_trained(path)
    synced = {"sync_s": time.perf_counter() - t0, **ctl.last_sync}
    ckpt.prune(RunLayout.checkpoints_of(path), keep_last)  # after the commit: the newest is never among the deleted
    with costs.mlflow():
        model_id = tracking.checkpoint_model(run.experiment_id, run.mlflow_run_id, path,
                                             {k: v for k, v in meta.items() if k != "metrics"})
    with costs.prefect():
        emit_event("rstar2.core.checkpoint.committed",
                   resource={"prefect.resource.id": f"rstar2.core.checkpoint.{meta.get('run', '')}."
                                                    f"{RunLayout.label(path, '.')}", "rstar2.path": path,
                             "rstar2.run": str(meta.get("run", "")), "rstar2.preset": str(meta.get("preset", "")),
                             "rstar2.run_dir": str(RunLayout.of_checkpoint(path).root)},
                   payload={"global_step": meta.get("global_step"), "mlflow_model_id": model_id})
    return {"path": path, **synced}


@task(name="evaluate", cache_policy=None, retries=1, retry_condition_fn=_retry_transient)
@costs.work
def evaluate(run: RunRef, cfg: RunCfg, model_dir: str, table: EvalTable, out_uri: str) -> dict:
    """pass@1 (with its SE and pass@k) of `model_dir` (already loaded in the engines) on one problem table, with the
    limits of cfg.eval. Its result is written next to the samples and reused by a retried run, so a finished
    evaluation is never redone."""
    out = RunLayout.eval_out_of(out_uri)
    res = runstate.recorded(out, model_dir)
    if res is not None:  # a result from before pass1_se/pass@k: its figures again from the same samples
        return res if "pass1_se" in res else {**res, **steps.eval_stats(out_uri)}
    ctl = controller(run)
    engines = ctl.engine_clients(cfg.eval.temperature, cfg.eval.top_p)
    with bar(f"evaluate {out.name}") as progress:
        check = ctl.verifier(cfg.sandbox) if table.answer_type == "math" else None
        res = steps.evaluate(engines, cfg.scheduler, model_dir, table.uri, cfg.eval, cfg.world.max_positions,
                             ctl.sandbox(cfg.sandbox), check, out_uri, on_done=progress, answer_type=table.answer_type)
    runstate.record(out, model_dir, res)
    return res


@task(name="log-evaluation", cache_policy=None)
@costs.work
def log_evaluation(run: RunRef, result: dict, model: ModelRef, split: str) -> str:
    """Attach an evaluation to the checkpoint's LoggedModel (and the run) in MLflow; a val split is prefixed so it
    never mixes with held-out test figures."""
    prefix = "eval_" if split == "test" else f"eval_{split}_"
    with costs.mlflow():
        model_id = tracking.checkpoint_model(run.experiment_id, run.mlflow_run_id, model.dir, model.meta)
        tracking.log_model_metrics(run.mlflow_run_id, model_id, {f"{prefix}{k}": v for k, v in result.items()},
                                   model.step)
    return model_id


@task(name="log-suites", cache_policy=None)
@costs.work
def log_suites(run: RunRef, results: dict[str, dict], model: ModelRef, name: str) -> str:
    """A checkpoint's evaluation on the suites: its table (suite x metric) logged and as a run artifact
    (`eval/<name>.json`), each figure as metric `eval/<suite>/<figure>` on the run and the checkpoint's LoggedModel."""
    log.info("%s", progress.text(report.suite_table(results, f"evaluation {name}: {model.dir}")))
    with costs.mlflow():
        model_id = tracking.checkpoint_model(run.experiment_id, run.mlflow_run_id, model.dir, model.meta)
        tracking.log_model_metrics(run.mlflow_run_id, model_id, {f"eval/{suite}/{k}": v for suite, res in
                                                                 results.items() for k, v in res.items()}, model.step)
        tracking.log_table(run.mlflow_run_id, report.suite_rows(results), f"eval/{name}.json")
    return model_id


@task(name="trajectory-samples", cache_policy=None)
@costs.work
def trajectory_samples(scored: dict, key: str, seed: int) -> str:
    """A markdown artifact with a few of the step's trajectories: tool calls, tool output, answer, reward; published
    off the step's path (rstar2.tasks.publish). Returns its key."""
    text = report.trajectory_markdown(scored["uri"], 3, seed)
    publish.later(create_markdown_artifact, text, key=key, description="sampled trajectories of the step")
    return key


@task(name="mine-hard", cache_policy=None, retries=1, retry_condition_fn=_retry_transient)
@costs.work
def mine_hard(run: RunRef, cfg: RunCfg, stage: StageCfg, checkpoint_dir: str) -> dict:
    """Sample cfg.mining.k rollouts per training problem with `checkpoint_dir` (loaded in the engines) and commit the
    hard set for `stage` in the run's mining directory; returns its lineage."""
    out_dir = run.layout.mining(stage.name, checkpoint_dir)
    if not ckpt.is_committed(out_dir):  # a retried run reuses a committed hard set
        ctl = controller(run)
        ctl.sync_weights(checkpoint_dir)
        engines = ctl.engine_clients(cfg.mining.temperature, 1.0)

        def write(tmp: Path) -> None:
            with bar("mine hard problems") as progress:
                mining.mine(engines, cfg.scheduler, checkpoint_dir, run.needs_world().train, cfg.mining,
                            cfg.rollout_for(stage), ctl.sandbox(cfg.sandbox), ctl.verifier(cfg.sandbox),
                            cfg.world.max_positions, str(tmp), cfg.rl_seed, on_done=progress)

        ckpt.commit(out_dir, write, {"kind": "hard-set", "checkpoint": checkpoint_dir})
    return mining.read_lineage(str(out_dir))


@task(name="load-weights", cache_policy=None)
@costs.work
def load_weights(run: RunRef, model_dir: str) -> str:
    """Every engine serves `model_dir` from now on."""
    return controller(run).sync_weights(model_dir)


@task(name="reset-optimizer", cache_policy=None)
@costs.work
def reset_optimizer(run: RunRef) -> None:
    controller(run).reset_optimizer()
