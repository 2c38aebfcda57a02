"""The RL step's tasks: rollout -> score -> sandbox stats -> RoC -> update -> checkpoint -> evaluate."""

import json
from pathlib import Path

import ray
from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.events import emit_event

from rstar2 import checkpoint as ckpt
from rstar2 import mining, report, steps, tracking
from rstar2.config import EvalCfg, MiningCfg, RoCCfg, RolloutCfg, RunCfg, SandboxCfg, SchedulerCfg
from rstar2.controller import Controller
from rstar2.progress import bar
from tasks import costs


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
def start_actors(ctl: Controller, cfg: RunCfg, model_dir: str, with_trainer: bool = True) -> dict:
    """The run's engines (kept once started) and, unless `with_trainer` is off, its trainer, from `model_dir`."""
    ctl.start(cfg, model_dir, with_trainer)
    return ctl.identity()


@task(name="restore-trainer", cache_policy=None)
@costs.work
def restore_trainer(ctl: Controller, ckpt_dir: str) -> str:
    """A retried run: the trainer (started from the checkpoint's weights) takes back its optimizer/LR/RNG state."""
    ctl.restore(ckpt_dir)
    return ckpt_dir


@task(name="restart-trainer", cache_policy=None)
@costs.work
def restart_trainer(ctl: Controller, cfg: RunCfg, model_dir: str) -> dict:
    """The next RL seed: a new trainer from `model_dir` with seed cfg.rl_seed and a fresh optimizer (engines kept)."""
    ctl.restart_trainer(cfg, model_dir)
    return ctl.identity()


@task(name="rollout", cache_policy=None, retries=2, retry_condition_fn=_retry_transient)
@costs.work
def rollout(ctl: Controller, tokenizer_dir: str, problems_uri: str, step: int, prompts: int, samples: int,
            limits: RolloutCfg, sandbox_cfg: SandboxCfg, seed: int, max_model_len: int, out_uri: str,
            sched_cfg: SchedulerCfg, logprobs: bool = False) -> dict:
    """The step's rollout through the scheduler (rstar2.scheduler): {"uri": the table, scheduling metrics}.
    `logprobs`: record the engine's log-prob of every sampled token (for trainer.old_logprobs=engine / tis_cap)."""
    engines = ctl.engine_clients(limits.temperature, limits.top_p, logprobs)
    problems = steps.select_prompts(problems_uri, step, prompts, seed)
    with bar(f"rollout step {step + 1}") as progress:
        info = steps.rollout_to_parquet(engines, sched_cfg, tokenizer_dir, problems, samples, limits,
                                        ctl.sandbox(sandbox_cfg), out_uri, max_model_len, on_done=progress,
                                        estimator=ctl.estimator, seed=f"{seed}/step{step}")
    return {"uri": out_uri, **{k: v for k, v in info.items() if k.startswith(("sched_", "rollout_"))}}


@task(name="score", cache_policy=None)
@costs.work
def score(ctl: Controller, rollouts_uri: str, sandbox_cfg: SandboxCfg, out_uri: str) -> str:
    steps.score(rollouts_uri, ctl.verifier(sandbox_cfg), out_uri)
    return out_uri


@task(name="sandbox-execution-stats", cache_policy=None)
@costs.work
def sandbox_stats(scored_uri: str) -> dict:
    return steps.sandbox_stats(scored_uri)


@task(name="roc-filter", cache_policy=None)
@costs.work
def roc_filter(scored_uri: str, roc_cfg: RoCCfg, keep: int, seed: int, out_uri: str) -> dict:
    return {"uri": out_uri, **steps.roc_filter(scored_uri, roc_cfg, keep, seed, out_uri)}


@task(name="batch-metrics", cache_policy=None)
@costs.work
def batch_metrics(scored_uri: str, roc: dict) -> dict:
    return steps.batch_metrics(scored_uri, roc["uri"])


@task(name="grpo-update", cache_policy=None)
@costs.work
def grpo_update(ctl: Controller, roc: dict) -> dict:
    return ctl.update(roc["uri"])


@task(name="checkpoint", cache_policy=None)
@costs.work
def checkpoint(ctl: Controller, update: dict, batch: dict, sandbox: dict, ckpt_dir: str, meta: dict,
               experiment_id: str, mlflow_run_id: str, keep_last: int | None = None) -> str:
    """Commit the trainer state atomically (the step's metrics sealed in its manifest), load the new weights into
    every engine in place (from the checkpoint or from the trainer's memory), delete the stage's checkpoints older
    than the newest `keep_last` (checkpoint.keep_last), record the checkpoint as an MLflow LoggedModel and announce
    it (evaluation deployments trigger on the event)."""
    meta = {**meta, "metrics": {**batch, **sandbox, **update}}
    path = ctl.save(ckpt_dir, meta)
    ctl.sync_trained(path)
    ckpt.prune(Path(path).parent, keep_last)  # after the commit: the newest is never among the deleted
    with costs.mlflow():
        model_id = tracking.checkpoint_model(experiment_id, mlflow_run_id, path,
                                             {k: v for k, v in meta.items() if k != "metrics"})
    with costs.prefect():
        emit_event("rstar2.checkpoint.committed",
                   resource={"prefect.resource.id": f"rstar2.checkpoint.{meta.get('run', '')}.{Path(path).parent.name}."
                                                    f"{Path(path).name}", "rstar2.path": path,
                             "rstar2.run": str(meta.get("run", "")), "rstar2.preset": str(meta.get("preset", "")),
                             "rstar2.run_dir": str(Path(path).parents[2])},  # <run>/checkpoints/<stage>/step-N
                   payload={"global_step": meta.get("global_step"), "mlflow_model_id": model_id})
    return path


@task(name="evaluate", cache_policy=None, retries=1, retry_condition_fn=_retry_transient)
@costs.work
def evaluate(ctl: Controller, model_dir: str, problems_uri: str, eval_cfg: EvalCfg, max_model_len: int,
             sandbox_cfg: SandboxCfg, out_uri: str, sched_cfg: SchedulerCfg, answer_type: str = "math") -> dict:
    """pass@1 (with its SE and pass@k) of `model_dir` (already loaded in the engines) on one problem table, answers
    checked as `answer_type`. Its result is written next to the samples and reused by a retried run, so a finished
    evaluation is never redone."""
    done = Path(out_uri).with_suffix(".json")
    if done.is_file() and json.loads(done.read_text()).get("model_dir") == model_dir:
        res = json.loads(done.read_text())["result"]
        # a result from before pass1_se/pass@k: its figures again from the same samples
        return res if "pass1_se" in res else {**res, **steps.eval_stats(out_uri)}
    engines = ctl.engine_clients(eval_cfg.temperature, eval_cfg.top_p)
    with bar(f"evaluate {Path(out_uri).stem}") as progress:
        check = ctl.verifier(sandbox_cfg) if answer_type == "math" else None
        res = steps.evaluate(engines, sched_cfg, model_dir, problems_uri, eval_cfg, max_model_len,
                             ctl.sandbox(sandbox_cfg), check, out_uri, on_done=progress, answer_type=answer_type)
    ckpt.write_atomic(done, json.dumps({"model_dir": model_dir, "result": res}))
    return res


@task(name="log-evaluation", cache_policy=None)
@costs.work
def log_evaluation(result: dict, experiment_id: str, mlflow_run_id: str, model_dir: str, meta: dict, step: int,
                   split: str) -> str:
    """Attach an evaluation to the checkpoint's LoggedModel (and the run) in MLflow; a val split is prefixed so it
    never mixes with held-out test figures."""
    prefix = "eval_" if split == "test" else f"eval_{split}_"
    with costs.mlflow():
        model_id = tracking.checkpoint_model(experiment_id, mlflow_run_id, model_dir, meta)
        tracking.log_model_metrics(mlflow_run_id, model_id, {f"{prefix}{k}": v for k, v in result.items()}, step)
    return model_id


@task(name="log-suites", cache_policy=None)
@costs.work
def log_suites(results: dict[str, dict], experiment_id: str, mlflow_run_id: str, model_dir: str, meta: dict,
               step: int, name: str) -> str:
    """A checkpoint's evaluation on the suites: its table (suite x metric) on the terminal and as a run artifact
    (`eval/<name>.json`), each figure as metric `eval/<suite>/<figure>` on the run and the checkpoint's LoggedModel."""
    from rich.console import Console

    Console(width=200).print(report.suite_table(results, f"evaluation {name}: {model_dir}"))
    with costs.mlflow():
        model_id = tracking.checkpoint_model(experiment_id, mlflow_run_id, model_dir, meta)
        tracking.log_model_metrics(mlflow_run_id, model_id, {f"eval/{suite}/{k}": v for suite, res in results.items()
                                                             for k, v in res.items()}, step)
        tracking.log_table(mlflow_run_id, report.suite_rows(results), f"eval/{name}.json")
    return model_id


@task(name="trajectory-samples", cache_policy=None)
@costs.work
def trajectory_samples(scored_uri: str, key: str, seed: int) -> str:
    """A markdown artifact with a few of the step's trajectories: tool calls, tool output, answer, reward."""
    text = report.trajectory_markdown(scored_uri, 3, seed)
    with costs.prefect():
        return str(create_markdown_artifact(text, key=key, description="sampled trajectories of the step"))


@task(name="mine-hard", cache_policy=None, retries=1, retry_condition_fn=_retry_transient)
@costs.work
def mine_hard(ctl: Controller, checkpoint_dir: str, train_uri: str, cfg: MiningCfg, limits: RolloutCfg,
              sandbox_cfg: SandboxCfg, max_model_len: int, out_dir: str, seed: int,
              sched_cfg: SchedulerCfg) -> dict:
    """Sample k rollouts per training problem with `checkpoint_dir` (loaded in the engines); commit the hard set."""
    if not ckpt.is_committed(Path(out_dir)):  # a retried run reuses a committed hard set
        ctl.sync_weights(checkpoint_dir)
        engines = ctl.engine_clients(cfg.temperature, 1.0)

        def write(tmp: Path) -> None:
            with bar("mine hard problems") as progress:
                mining.mine(engines, sched_cfg, checkpoint_dir, train_uri, cfg, limits, ctl.sandbox(sandbox_cfg),
                            ctl.verifier(sandbox_cfg), max_model_len, str(tmp), seed, on_done=progress)

        ckpt.commit(Path(out_dir), write, {"kind": "hard-set", "checkpoint": checkpoint_dir})
    return mining.read_lineage(out_dir)


@task(name="load-weights", cache_policy=None)
@costs.work
def load_weights(ctl: Controller, model_dir: str) -> str:
    """Every engine serves `model_dir` from now on."""
    return ctl.sync_weights(model_dir)


@task(name="reset-optimizer", cache_policy=None)
@costs.work
def reset_optimizer(ctl: Controller) -> None:
    ctl.reset_optimizer()
