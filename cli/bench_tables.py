"""The tables `rstar2 bench rollout` prints (rich): the simulated policy comparison and the real run on vLLM engines;
the bench (bench/rollout_sim.py, bench/rollout_real.py) gathers the figures."""

from __future__ import annotations

from rich.table import Table

# the essentials, short headers (a terminal's width); every figure is in the JSON
_REAL_COLS = {"policy": lambda r: r["policy"],
              "makespan s (min-max)": lambda r: f"{r['makespan_s']} ({r['makespan_min_s']}-{r['makespan_max_s']})",
              "tok/s": lambda r: f"{r['tokens_per_s']:.0f}",
              "÷ raw (min-max)": lambda r: (f"{r['vs_raw_generate']} ({r['vs_raw_generate_min']}-"
                                            f"{r['vs_raw_generate_max']})"),
              "÷ replay": lambda r: str(r["vs_replay"]),
              "kv_aware ÷ this": lambda r: (f"{r['kv_aware_ratio']:.2f} ({r['kv_aware_ratio_min']:.2f}-"
                                            f"{r['kv_aware_ratio_max']:.2f})" if "kv_aware_ratio" in r else "-"),
              "preempt": lambda r: f"{r['preemptions']:g}", "KV max": lambda r: str(r["kv_usage_max"]),
              "in flight": lambda r: str(r["peak_inflight"])}


def _cpu(by_role: dict) -> str:
    """A run's CPU seconds: driver / engines / sandbox."""
    return "/".join(f"{by_role[k]:.1f}" for k in ("driver", "engines", "sandbox"))


def rollout_real_table(res: dict, c: dict) -> Table:
    """One KV configuration of the real rollout bench, per policy."""
    table = Table(title=f"real rollout: {res['engines']} vLLM engines, {res['prompts']}x{res['samples']}, KV "
                        f"{c['kv_capacity_tokens']} tokens/engine, median of {res['rounds']} rounds, raw generate "
                        f"{c['raw_tokens_per_s_median']:.0f} tok/s, replay {c['replay_tokens_per_s_median']:.0f} "
                        f"tok/s, {max(r['tool_calls'] for r in c['policies'])} tool calls per batch (load avg "
                        f"{res['load_avg_start'][0]:.2f} at start)")
    for col in _REAL_COLS:
        table.add_column(col, justify="left" if col == "policy" else "right")
    for r in c["policies"]:
        table.add_row(*[f(r) for f in _REAL_COLS.values()])
    table.caption = "CPU s per batch, driver/engines/sandbox (its replay's): " + ", ".join(
        f"{r['policy']} {_cpu(r['cpu_s'])} ({_cpu(r['replay_cpu_s'])})" for r in c["policies"])
    return table


_SIM_COLS = ["scenario", "policy", "makespan_s", "x_best", "x_best_max", "x_oracle", "x_round_robin",
             "x_least_requests", "static_speedup", "x_naive_bound", "idle_frac", "recompute_frac", "preemptions",
             "queue_wait_mean_s"]


def rollout_sim_table(sim: dict) -> Table:
    """The simulated policy comparison: per scenario and policy, the median figures over seeds."""
    table = Table(title=f"rollout scheduling, simulated: {sim['engines']} engines, {sim['prompts']}x32, ICC "
                        f"{sim['icc']:.3f}, median of {sim['seeds']} seeds")
    for c in _SIM_COLS:
        table.add_column(c, justify="left" if c in ("scenario", "policy") else "right")
    for r in sim["summary"]:
        table.add_row(*[r[c] if isinstance(r[c], str) else "-" if r[c] is None else f"{r[c]:.3g}" for c in _SIM_COLS])
    return table
