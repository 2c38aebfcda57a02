"""Reports: the trajectory markdown and the comparison plots."""

import polars as pl

from rstar2 import report


def test_comparison_plots_write_one_png_per_curve(tmp_path):
    curves = {"roc": {"reward_mean": [(1, 0.2), (2, 0.3)], "pass1_train": [(1, 0.2)]},
              "plain-grpo": {"reward_mean": [(1, 0.1), (2, 0.15)]}}
    paths = report.comparison_plots(curves, str(tmp_path), "t")
    assert sorted(p.split("/")[-1] for p in paths) == sorted(f"{m}.png" for m in report.CURVES)
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
