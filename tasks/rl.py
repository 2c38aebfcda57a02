"""The RL step's tasks: rollout -> score -> sandbox stats -> RoC -> update -> checkpoint -> evaluate."""

import ray
from prefect import task

from rstar2 import cluster, steps
from rstar2.config import EvalCfg, RoCCfg, RolloutCfg, RunCfg, SandboxCfg


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
def start_actors(run_id: str, cfg: RunCfg, model_dir: str) -> dict:
    engines, trainer = cluster.start(run_id, cfg, model_dir)
    return {"engines": engines, "trainer": trainer}


@task(name="rollout", cache_policy=None, retries=2, retry_condition_fn=_retry_transient)
def rollout(actors: dict, tokenizer_dir: str, problems_uri: str, step: int, prompts: int, samples: int,
            limits: RolloutCfg, sandbox_cfg: SandboxCfg, seed: int, max_model_len: int, out_uri: str) -> str:
    gen = cluster.engine_generate(actors["engines"], limits.temperature, limits.top_p)
    problems = steps.select_prompts(problems_uri, step, prompts, seed)
    steps.rollout_to_parquet(gen, tokenizer_dir, problems, samples, limits, sandbox_cfg, out_uri, max_model_len)
    return out_uri


@task(name="score", cache_policy=None)
def score(rollouts_uri: str, sandbox_cfg: SandboxCfg, out_uri: str) -> str:
    steps.score(rollouts_uri, sandbox_cfg, out_uri)
    return out_uri


@task(name="sandbox-execution-stats", cache_policy=None)
def sandbox_stats(scored_uri: str) -> dict:
    return steps.sandbox_stats(scored_uri)


@task(name="roc-filter", cache_policy=None)
def roc_filter(scored_uri: str, roc_cfg: RoCCfg, keep: int, seed: int, out_uri: str) -> dict:
    return {"uri": out_uri, **steps.roc_filter(scored_uri, roc_cfg, keep, seed, out_uri)}


@task(name="batch-metrics", cache_policy=None)
def batch_metrics(scored_uri: str, roc: dict) -> dict:
    return steps.batch_metrics(scored_uri, roc["uri"])


@task(name="grpo-update", cache_policy=None)
def grpo_update(actors: dict, roc: dict) -> dict:
    return ray.get(cluster.get(actors["trainer"]).update.remote(roc["uri"]))


@task(name="checkpoint", cache_policy=None)
def checkpoint(actors: dict, update: dict, ckpt_dir: str, meta: dict) -> str:
    """Commit the trainer state atomically, then load the new weights into every engine in place."""
    path = ray.get(cluster.get(actors["trainer"]).save.remote(ckpt_dir, meta))
    ray.get([cluster.get(e).load_weights.remote(path) for e in actors["engines"]])
    return path


@task(name="evaluate", cache_policy=None, retries=1, retry_condition_fn=_retry_transient)
def evaluate(actors: dict, model_dir: str, problems_uri: str, eval_cfg: EvalCfg, max_model_len: int,
             sandbox_cfg: SandboxCfg, out_uri: str) -> dict:
    gen = cluster.engine_generate(actors["engines"], eval_cfg.temperature, 1.0)
    return steps.evaluate(gen, model_dir, problems_uri, eval_cfg, max_model_len, sandbox_cfg, out_uri)


@task(name="resume", cache_policy=None)
def resume(actors: dict, ckpt_dir: str) -> dict:
    """Restart from a committed checkpoint: the trainer's full state (weights, optimizer, LR schedule, RNGs, step),
    then the same weights into every engine. Returns the checkpoint's meta (stage, step, global_step)."""
    meta = ray.get(cluster.get(actors["trainer"]).load_state.remote(ckpt_dir))
    ray.get([cluster.get(e).load_weights.remote(ckpt_dir) for e in actors["engines"]])
    return meta


@task(name="reset-optimizer", cache_policy=None)
def reset_optimizer(actors: dict) -> None:
    ray.get(cluster.get(actors["trainer"]).reset_optimizer.remote())
