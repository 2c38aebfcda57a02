"""The real rollout bench's printed table: one row per policy with the figures of its JSON, readable at 130 columns."""

from rich.console import Console

from rstar2.cli import _real_table


def test_real_bench_table_shows_each_policys_figures_on_one_line():
    pol = {"policy": "kv_aware", "makespan_s": 4.89, "makespan_min_s": 4.42, "makespan_max_s": 5.19,
           "tokens_per_s": 1837.2, "vs_raw_generate": 0.548, "vs_raw_generate_min": 0.532, "vs_raw_generate_max": 0.605,
           "vs_replay": 0.81, "vs_replay_min": 0.77, "vs_replay_max": 0.93,
           "preemptions": 1.5, "kv_usage_max": 0.669, "peak_inflight": 44, "peak_waiting_in_vllm": 0, "tool_calls": 156}
    res = {"engines": 2, "prompts": 16, "samples": 16, "rounds": 3, "load_avg_start": (1.0, 1.0, 1.0)}
    cfg = {"kv_capacity_tokens": [4096, 4096], "raw_tokens_per_s_median": 3346.0, "replay_tokens_per_s_median": 2210.4,
           "policies": [pol, {**pol, "policy": "round_robin", "preemptions": 95}]}
    console = Console(width=130, record=True)
    console.print(_real_table(res, cfg))
    lines = console.export_text().splitlines()
    row = next(line for line in lines if "kv_aware" in line)
    for cell in ("4.89 (4.42-5.19)", "1837", "0.548 (0.532-0.605)", "0.81", "1.5", "0.669", "44", "156"):
        assert cell in row
    assert "95" in next(line for line in lines if "round_robin" in line)
    title = " ".join(line.strip() for line in lines[:2])
    assert "KV [4096, 4096] tokens/engine" in title and "raw generate 3346" in title and "replay 2210" in title
