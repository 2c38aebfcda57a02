"""Reports: the trajectory markdown and the comparison plots."""

import polars as pl
import pytest

from rstar2.evaluation import report


def test_comparison_plots_write_one_png_per_curve_with_data(tmp_path):
    curves = {"roc": {"reward_mean": [(1, 0.2), (2, 0.3)], "pass1_train": [(1, 0.2)], "entropy": []},
              "plain-grpo": {"reward_mean": [(1, 0.1), (2, 0.15)]}}
    paths = report.comparison_plots(curves, str(tmp_path), "t")
    assert sorted(p.split("/")[-1] for p in paths) == ["pass1_train.png", "reward_mean.png"]  # no empty chart
    assert sorted(f.name for f in tmp_path.iterdir()) == ["pass1_train.png", "reward_mean.png"]
    assert all((tmp_path / p.split("/")[-1]).read_bytes()[:4] == b"\x89PNG" for p in paths)
    rows = report.per_step_rows(curves)
    assert rows[0] == {"variant": "roc", "step": 1, "reward_mean": 0.2, "pass1_train": 0.2}
    assert rows[-1] == {"variant": "plain-grpo", "step": 2, "reward_mean": 0.15}
    assert "| roc | 2 | 0.3 |" in report.per_step_markdown(rows)


def test_trajectory_markdown_shows_positives_and_negatives(tmp_path):
    uri = tmp_path / "scored.parquet"
    pl.DataFrame({"problem_id": ["a", "b"], "sample_idx": [0, 1], "gold": ["3", "4"], "reward": [1.0, 0.0],
                  "num_turns": [2, 1], "num_tool_calls": [1, 0], "tool_statuses": [["ok"], []],
                  "truncated": [False, False], "p_err": [0.0, 0.5], "p_format": [0.0, 0.0],
                  "response_text": ["<tool_call>x</tool_call> \\boxed{3}", "\\boxed{5}"]}).write_parquet(uri)
    md = report.trajectory_markdown(str(uri), n=2)
    assert "a (sample 0): reward 1, gold 3" in md and "b (sample 1): reward 0, gold 4" in md and "['ok']" in md


def test_comparison_plots_draw_seeds_as_a_mean_with_a_band(tmp_path):
    seeds = [{"reward_mean": [(1, 0.2), (2, 0.4)]}, {"reward_mean": [(1, 0.4), (2, 0.6)]}]
    paths = report.comparison_plots({"tiny": seeds}, str(tmp_path), "t")
    assert [p.split("/")[-1] for p in paths] == ["reward_mean.png"]
    assert report.mean_curves(seeds) == {"reward_mean": [(1, pytest.approx(0.3)), (2, pytest.approx(0.5))]}


# a recorded table: one SFT evaluation and three seeds' final evaluations on the same split
SFT = {"pass1": 0.40, "pass1_se": 0.03, "pass_at_1": 0.40, "pass_at_2": 0.55}
SEEDS = [{"rl_seed": 0, "pass1": 0.50, "pass1_se": 0.02, "pass_at_1": 0.50, "pass_at_2": 0.60},
         {"rl_seed": 1, "pass1": 0.55, "pass1_se": 0.04, "pass_at_1": 0.55, "pass_at_2": 0.70},
         {"rl_seed": 2, "pass1": 0.45, "pass1_se": 0.03, "pass_at_1": 0.45, "pass_at_2": 0.65}]


def test_seed_aggregate_against_a_hand_computation():
    agg = report.seed_aggregate(SFT, SEEDS)
    # gains 0.10, 0.15, 0.05: mean 0.10, sd 0.05, half width t(2) 0.05 / sqrt(3) = 4.3027 * 0.028868 = 0.124207
    assert agg["seeds"] == 3 and agg["rl_seeds"] == [0, 1, 2]
    assert agg["pass1_sft"] == 0.40 and agg["pass1_sft_se"] == 0.03
    assert agg["pass1_rl"] == pytest.approx(0.50) and agg["pass1_rl_by_seed"] == [0.50, 0.55, 0.45]
    assert agg["pass1_gain"] == agg["pass1_gain_mean"] == pytest.approx(0.10)
    assert (agg["pass1_gain_min"], agg["pass1_gain_max"]) == (pytest.approx(0.05), pytest.approx(0.15))
    assert agg["pass1_gain_ci95"] == pytest.approx([0.10 - 0.124207, 0.10 + 0.124207], abs=1e-5)
    assert agg["pass1_se"] == pytest.approx(0.03)  # (0.02 + 0.04 + 0.03) / 3
    assert agg["pass_at_2_sft"] == 0.55 and agg["pass_at_2_rl"] == pytest.approx(0.65)
    assert [s["pass1_gain"] for s in agg["by_seed"]] == pytest.approx([0.10, 0.15, 0.05])
    one = report.seed_aggregate(SFT, SEEDS[:1])  # one seed: the interval is the value itself
    assert one["pass1_gain"] == pytest.approx(0.10) and one["pass1_gain_ci95"] == pytest.approx([0.10, 0.10])


def test_ablation_summary_compares_each_variant_with_the_first():
    def summary(rl):
        return {**report.seed_aggregate(SFT, [{**SEEDS[i], "pass1": v} for i, v in enumerate(rl)]), "steps": 1,
                "wall_s": 10.0}

    res = report.ablation_summary({"roc": summary([0.50, 0.55, 0.45]), "plain-grpo": summary([0.40, 0.42, 0.38]),
                                   "no-tool": summary([0.30, 0.31, 0.29])})
    assert [r["variant"] for r in res["variants"]] == ["roc", "plain-grpo", "no-tool"]
    assert res["variants"][0]["gain"] == 0.1 and res["variants"][0]["gain_ci95"] == [-0.0242, 0.2242]
    plain, no_tool = res["comparisons"]
    # plain-grpo - roc: -0.10; var/n 0.0004/3 and 0.0025/3: s2 = 0.00096667, Welch df 2.624, t 3.4566:
    # half width 3.4566 * 0.031091 = 0.107471 -> [-0.2075, 0.0075]: includes 0
    assert plain["baseline"] == "roc" and plain["diff"] == -0.1 and plain["ci95"] == [-0.2075, 0.0075]
    assert plain["beyond_noise"] is False
    # no-tool - roc: -0.20, s2 = 0.0001/3 + 0.0025/3, df 2.16: the interval stays below 0
    assert no_tool["diff"] == -0.2 and no_tool["ci95"][1] < 0 and no_tool["beyond_noise"] is True


def test_last_steps_summary_on_a_recorded_table():
    nan = float("nan")

    def seed(ter, length):  # one seed's curves over steps 1..5
        return {"tool_error_rate_pos": list(enumerate(ter, 1)), "response_len_mean": [(s, length) for s in range(1, 6)]}

    curves = {"roc": [seed([0.2, 0.1, 0.02, 0.04, 0.0], 100), seed([0.2, 0.1, 0.03, 0.03, 0.03], 102),
                      seed([0.2, 0.1, 0.01, 0.01, 0.04], 104)],
              "plain-grpo": [seed([0.2, 0.2, 0.12, 0.12, 0.12], 120), seed([0.2, 0.2, 0.1, 0.1, 0.1], 118),
                             seed([0.2, 0.2, 0.11, nan, 0.11], 122)]}  # a step with no positives: NaN, left out
    res = report.last_steps_summary(curves, last=3)
    roc, plain = res["variants"]["roc"], res["variants"]["plain-grpo"]
    # last 3 steps per seed: roc 0.02, 0.03, 0.02 (steps 1-2's 0.2 left out); mean 0.023333,
    # sd sqrt((2 * 0.003333^2 + 0.006667^2) / 2) = 0.0057735, half width t(2) 4.302653 * 0.0057735 / sqrt(3) = 0.014342
    assert roc["tool_error_rate_pos"] == {"mean": 0.0233, "min": 0.02, "max": 0.03, "ci95": [0.009, 0.0377],
                                          "seeds": 3, "by_seed": [0.02, 0.03, 0.02]}
    # plain-grpo 0.12, 0.10, 0.11: sd 0.01, half width 4.302653 * 0.01 / sqrt(3) = 0.024841
    assert plain["tool_error_rate_pos"]["ci95"] == [0.0852, 0.1348]
    assert plain["response_len_mean"]["mean"] == 120 and roc["response_len_mean"]["ci95"] == [97.0317, 106.9683]
    assert "reward_mean" not in roc  # a figure no seed logged is left out
    vs = res["vs_baseline"]["plain-grpo"]["tool_error_rate_pos"]
    assert vs["baseline"] == "roc" and vs["diff"] == 0.0867 and vs["intervals_apart"] is True
    assert vs["beyond_noise"] is True
    # paired by seed, plain over roc: ln(0.125/0.025) = 1.60944, ln(0.105/0.035) = 1.09861, ln(0.115/0.025) = 1.52606;
    # mean 1.41137, sd 0.27405, half width 4.302653 x 0.27405 / sqrt 3 = 0.68077: ratio e^1.41137 = 4.1016 in
    # [e^0.73060, e^2.09214] = [2.0763, 8.1022], above 1: RoC's rate is lower
    assert vs["paired_ratio"] == {"ratio": 4.1016, "ci95": [2.0763, 8.1022], "lower": False, "higher": True}
    assert "paired_ratio" not in res["vs_baseline"]["plain-grpo"]["response_len_mean"]  # rates only
    one = report.last_steps_summary({"roc": curves["roc"][:1], "plain-grpo": curves["plain-grpo"][:1]}, last=3)
    assert one["vs_baseline"]["plain-grpo"]["tool_error_rate_pos"]["intervals_apart"] is False  # no interval
    rows = report.last_steps_rows(res)
    assert {"variant": "plain-grpo", "figure": "tool_error_rate_pos", "mean": 0.11, "min": 0.1, "max": 0.12,
            "ci95": "[0.0852, 0.1348]", "seeds": 3,
            "vs_baseline": "+0.0867 (intervals apart); paired ratio 4.1016 [2.0763, 8.1022]"} in rows


def test_world_aggregate_against_a_hand_computation():
    other_sft = {**SFT, "pass1": 0.30}
    other = [{**s, "pass1": v} for s, v in zip(SEEDS, (0.50, 0.45, 0.49))]  # gains 0.20, 0.15, 0.19
    agg = report.world_aggregate({5: report.seed_aggregate(other_sft, other), 3: report.seed_aggregate(SFT, SEEDS)})
    # six gains 0.10 0.15 0.05 | 0.20 0.15 0.19: mean 0.14, sd sqrt(0.016 / 5) = 0.056569,
    # half width t(5) sd / sqrt(6) = 2.570582 * 0.023094 = 0.059365; world means 0.10, 0.18: half width
    # t(1) 0.056569 / sqrt(2) = 12.706205 * 0.04 = 0.508248
    assert agg["world_seeds"] == [3, 5] and agg["rl_seeds"] == [0, 1, 2]
    assert [(r["world_seed"], r["rl_seed"]) for r in agg["runs"]] == [(w, s) for w in (3, 5) for s in (0, 1, 2)]
    assert [r["pass1_gain"] for r in agg["runs"]] == pytest.approx([0.10, 0.15, 0.05, 0.20, 0.15, 0.19])
    assert agg["runs"][3]["pass1_sft"] == 0.30  # each run's gain is from its own world's SFT model
    assert (agg["pass1_gain_mean"], agg["pass1_gain_min"], agg["pass1_gain_max"]) == (
        pytest.approx(0.14), pytest.approx(0.05), pytest.approx(0.20))
    assert agg["pass1_gain_ci95"] == pytest.approx([0.14 - 0.059365, 0.14 + 0.059365], abs=1e-5)
    assert agg["pass1_gain_worlds_ci95"] == pytest.approx([0.14 - 0.508248, 0.14 + 0.508248], abs=1e-5)
    assert agg["pass1_gain_by_world"] == {"3": pytest.approx(0.10), "5": pytest.approx(0.18)}
