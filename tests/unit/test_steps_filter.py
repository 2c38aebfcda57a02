"""The RL step's RoC filter and sandbox figures over a scored table (rstar2/run/steps.py), RoC on and off."""

import polars as pl
import pytest

from rstar2.core.config import RoCCfg
from rstar2.run import steps


@pytest.fixture
def scored(tmp_path):
    """Prompt a: mixed rewards (4 rollouts), b: all correct, c: all wrong."""
    rows = [("a", 1.0), ("a", 0.0), ("a", 1.0), ("a", 0.0), ("b", 1.0), ("b", 1.0), ("c", 0.0), ("c", 0.0)]
    uri = tmp_path / "scored.parquet"
    pl.DataFrame({"problem_id": [p for p, _ in rows], "reward": [r for _, r in rows], "p_err": [0.0] * 8,
                  "p_format": [0.0] * 8,
                  "tool_statuses": [["ok", "output_truncated"], ["error"], [], ["timeout", "ok"]] + [["ok"]] * 4,
                  "tool_wall_s": [[0.1, 0.2], [0.1], [], [0.3, 0.1]] + [[0.1]] * 4}).write_parquet(uri)
    return uri


@pytest.mark.parametrize("enabled, keep, kept", [(False, 2, 4), (True, 2, 2)])
def test_roc_filter_drops_all_equal_groups_with_roc_on_or_off(scored, tmp_path, enabled, keep, kept):
    res = steps.roc_filter(str(scored), RoCCfg(enabled=enabled), keep, 0, str(tmp_path / "kept.parquet"))
    assert res == {"roc_kept": kept, "roc_dropped": 8 - kept, "roc_dropped_groups": 2}
    assert set(pl.read_parquet(tmp_path / "kept.parquet")["problem_id"]) == {"a"}


def test_roc_filter_keeps_everything_when_roc_and_the_drop_are_off(scored, tmp_path):
    res = steps.roc_filter(str(scored), RoCCfg(enabled=False, drop_all_equal=False), 2, 0, str(tmp_path / "k.parquet"))
    assert res == {"roc_kept": 8, "roc_dropped": 0, "roc_dropped_groups": 0}


def test_sandbox_stats_counts_truncated_output_as_ok(scored):
    res = steps.sandbox_stats(str(scored), {})
    assert res["tool_calls"] == 9 and res["tool_error_rate"] == pytest.approx(2 / 9)


def test_scoring_math_without_a_verifier_is_refused_naming_the_table(tmp_path):
    uri = tmp_path / "rollouts.parquet"
    pl.DataFrame({"final_text": ["<answer>\\boxed{4}</answer>"], "gold": ["4"],
                  "truncated": [False]}).write_parquet(uri)
    with pytest.raises(ValueError, match="rollouts.parquet as math needs a verifier"):
        steps.score(str(uri), None, str(tmp_path / "scored.parquet"))
    assert not (tmp_path / "scored.parquet").exists()  # nothing half-written
