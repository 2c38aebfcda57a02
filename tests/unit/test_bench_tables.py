"""The real rollout bench's printed table: one row per policy with the figures of its JSON, readable at 130 columns."""

from rich.console import Console

from rstar2.cli.bench_tables import rollout_real_table


def test_real_bench_table_shows_each_policys_figures_on_one_line():
    pol = {"policy": "kv_aware", "makespan_s": 4.89, "makespan_min_s": 4.42, "makespan_max_s": 5.19,
           "tokens_per_s": 1837.2, "vs_raw_generate": 0.548, "vs_raw_generate_min": 0.532, "vs_raw_generate_max": 0.605,
           "vs_replay": 0.81, "vs_replay_min": 0.77, "vs_replay_max": 0.93,
           "preemptions": 1.5, "kv_usage_max": 0.669, "peak_inflight": 44, "peak_waiting_in_vllm": 0, "tool_calls": 156,
           "cpu_s": {"driver": 0.41, "engines": 6.93, "sandbox": 0.52, "other": 0.1},
           "replay_cpu_s": {"driver": 0.02, "engines": 6.5, "sandbox": 0.0, "other": 0.1}}
    res = {"engines": 2, "prompts": 16, "samples": 16, "rounds": 3, "load_avg_start": (1.0, 1.0, 1.0)}
    cfg = {"kv_capacity_tokens": [4096, 4096], "raw_tokens_per_s_median": 3346.0, "replay_tokens_per_s_median": 2210.4,
           "policies": [pol, {**pol, "policy": "round_robin", "preemptions": 95, "kv_aware_ratio": 1.214,
                              "kv_aware_ratio_min": 1.087, "kv_aware_ratio_max": 1.301}]}
    console = Console(width=130, record=True)
    console.print(rollout_real_table(res, cfg))
    lines = console.export_text().splitlines()
    row = next(line for line in lines if line.startswith("│ kv_aware"))
    for cell in ("4.89 (4.42-5.19)", "1837", "0.548 (0.532-0.605)", "0.81", "1.5", "0.669", "44"):
        assert cell in row
    rr = next(line for line in lines if line.startswith("│ round_robin"))
    assert "95" in rr and "1.21 (1.09-1.30)" in rr  # kv_aware's makespan over round robin's, same round
    title = " ".join(line.strip() for line in lines[:2])
    assert "KV [4096, 4096] tokens/engine" in title and "raw generate 3346" in title and "replay 2210" in title
    assert "156 tool calls per batch" in title
    caption = " ".join(line.strip() for line in lines[lines.index(next(x for x in lines if x.startswith("└"))) + 1:])
    assert "kv_aware 0.4/6.9/0.5 (0.0/6.5/0.0)" in caption  # where the CPU went: driver/engines/sandbox (replay)


def test_real_bench_compares_kv_aware_with_each_policy_round_by_round():
    """kv_aware's makespan over each other policy's in the same round (load changes between rounds cancel): the
    median, range and the rounds kv_aware was faster; none for kv_aware itself."""
    from rstar2.bench.rollout_real import ROLES, _summarize

    spans = {0: {"kv_aware": 3.0, "round_robin": 2.5}, 1: {"kv_aware": 2.0, "round_robin": 2.5},
             2: {"kv_aware": 3.3, "round_robin": 3.0}}
    runs = [{"round": r, "policy": p, "makespan_s": m, "tokens_per_s": 1.0, "vs_raw_generate": 0.5, "vs_replay": 0.6,
             "generated_tokens": 10, "preemptions": 0, "kv_usage_max": [0.5], "tool_wait_s": 1.0,
             "queue_wait_mean_s": 0.0, "mean_turns": 1.5, "tool_calls": 3, "peak_inflight": [4],
             "peak_waiting_in_vllm": [0], "cpu_s": dict.fromkeys(ROLES, 1.0), "replay_cpu_s": dict.fromkeys(ROLES, 0.5)}
            for r, d in spans.items() for p, m in d.items()]
    kv, rr = _summarize(runs, ["kv_aware", "round_robin"])
    assert "kv_aware_ratio" not in kv
    assert rr["kv_aware_ratio"] == 1.1 and rr["kv_aware_ratio_min"] == 0.8 and rr["kv_aware_ratio_max"] == 1.2
    assert rr["kv_aware_faster_rounds"] == 1
    assert rr["cpu_s"] == dict.fromkeys(ROLES, 1.0) and rr["replay_cpu_s"] == dict.fromkeys(ROLES, 0.5)


def test_campaign_and_ablation_tables_show_seeds_and_their_summary():
    from rstar2.cli.tables import ablation_tables, campaign_table
    from rstar2.evaluation import report

    sft = {"pass1": 0.40, "pass1_se": 0.03, "pass_at_1": 0.40, "pass_at_2": 0.55}
    seeds = [{"rl_seed": i, "steps": 2, "pass1": v, "pass1_se": 0.02, "pass_at_1": v, "pass_at_2": v + 0.1}
             for i, v in enumerate([0.50, 0.55, 0.45])]
    summary = {**report.seed_aggregate(sft, seeds), "eval_samples": 2, "eval_problems": 6, "steps": 2,
               "wall_s": 10.0}
    console = Console(width=200, record=True)
    console.print(campaign_table(summary, "tiny"))
    text = console.export_text()
    assert "0.400 ± 0.030" in text and "0.650" in text  # SFT's pass@1 ± se; seed 0's pass@2
    assert "0.500 [0.450, 0.550]" in text and "+0.100 [+0.050, +0.150] (-0.024, +0.224)" in text
    curves = [{"tool_error_rate_pos": [(1, 0.3), (2, v)]} for v in (0.1, 0.2, 0.3)]
    res = {**report.ablation_summary({"roc": summary, "plain-grpo": summary}), "seeds": 3,
           "last_steps": report.last_steps_summary({"roc": curves, "plain-grpo": curves}, 1)}
    for t in ablation_tables(res, "abl", "tiny"):
        console.print(t)
    text = console.export_text()
    assert "plain-grpo" in text and "+0.000" in text and "no" in text
    assert "tool_error_rate_pos" in text and "[-0.0484, 0.4484]" in text  # 0.2 +- 4.302653 * 0.1 / sqrt(3) = 0.2484


def test_worlds_table_and_the_ablations_paired_conclusion():
    from rstar2.cli.tables import ablation_conclusions, worlds_table
    from rstar2.evaluation import report

    sft = {"pass1": 0.40, "pass1_se": 0.03}
    worlds = {w: report.seed_aggregate({**sft, "pass1": 0.40 - 0.1 * w},
                                       [{"rl_seed": i, "pass1": v, "pass1_se": 0.02} for i, v in enumerate([0.6, 0.7])])
              for w in (0, 1)}  # gains 0.20 0.30 | 0.30 0.40
    summary = {**report.world_aggregate(worlds), "seeds": 2, "eval_samples": 4, "eval_problems": 200}
    console = Console(width=200, record=True)
    console.print(worlds_table(summary, "tiny"))
    text = console.export_text()
    assert "over 2 worlds x 2 RL seeds" in text and "0.300" in text and "+0.400" in text
    assert "+0.300 [+0.200, +0.400]" in text  # mean [min, max] of the four gains
    curves = {"roc": [{"tool_error_rate_pos": [(1, v)]} for v in (0.02, 0.03, 0.02)],
              "plain-grpo": [{"tool_error_rate_pos": [(1, v)]} for v in (0.12, 0.10, 0.11)]}
    res = {"last_steps": report.last_steps_summary(curves, 1)}
    assert ablation_conclusions(res) == ["tool-error rate among positives, plain-grpo / roc seed by seed: 4.10x "
                                         "(95 % interval 2.08x-8.10x): plain-grpo's is higher"]
