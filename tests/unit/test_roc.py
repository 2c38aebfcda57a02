"""GRPO-RoC selection (rstar2/training/roc.py): hand-worked cases of paper Eq. 4-5 and of the quotas."""

import numpy as np
import pytest

from rstar2.training.roc import count_answer_blocks, is_all_equal, p_err, p_format, quotas, roc_select, select_group


# ---------------------------------------------------------------- p_err (Eq. 4) per tool-status mix
@pytest.mark.parametrize("statuses, expected", [
    ([], 0.5),                                   # no tool call: paper's fixed 0.5
    (["ok"], 0.0),                               # 0 errors / 1 call
    (["error"], 1.0),                            # Python exception: 1 / 1
    (["timeout"], 1.0),                          # the release scores this 0.0 (no "error" substring)
    (["parse_error"], 1.0),                      # JSON decode failure: release also 0.0
    (["memory"], 1.0), (["killed"], 1.0),
    (["output_truncated"], 0.0),                 # ran fine, just printed too much
    (["ok", "error", "ok"], 1 / 3),              # 1 error / 3 calls
    (["timeout", "ok", "parse_error", "output_truncated"], 0.5),  # 2 / 4
])
def test_p_err(statuses, expected):
    assert p_err(statuses) == pytest.approx(expected)


# ---------------------------------------------------------------- p_format (Eq. 5)
@pytest.mark.parametrize("answers, unclosed, turns, expected", [
    (0, False, 3, 1.0),     # no answer block
    (1, False, 1, 0.0),     # single-turn, tool-free, one answer: (1-1)/1 = 0 (release: 1.0, first turn unseen)
    (1, False, 4, 0.0),     # one answer after tool turns: (1-1)/4 = 0
    (2, False, 2, 0.5),     # (2-1)/2
    (3, False, 2, 1.0),     # min(1, (3-1)/2)
    (4, False, 2, 1.0),     # min(1, 3/2)
    (1, True, 2, 1.0),      # unclosed / unbalanced tags
    (1, False, 0, 0.0),     # inconsistent 0 turns is treated as 1: (1-1)/1
])
def test_p_format(answers, unclosed, turns, expected):
    assert p_format(answers, unclosed, turns) == pytest.approx(expected)


@pytest.mark.parametrize("text, expected", [
    ("no answer here", (0, False)),
    ("</reason> <answer>\\boxed{4}</answer>", (1, False)),
    ("<answer>1</answer> more <answer>\n2\n</answer>", (2, False)),
    ("<answer>\\boxed{4}", (0, True)),                     # unclosed
    ("<answer>1</answer> <answer>2", (1, True)),           # one pair plus a dangling open tag
    ("stray </answer> <answer>1</answer>", (1, True)),     # stray close tag
])
def test_count_answer_blocks(text, expected):
    assert count_answer_blocks(text) == expected


def test_penalty_of_tool_free_clean_answer():
    # A clean one-turn answer without tool calls: p_err 0.5 (no call) + p_format 1.0 = 1.5 in the release, which
    # never sees the first turn; with all turns counted it is 0.5 + 0.0.
    n, bad = count_answer_blocks("<reason> 2+2=4 </reason> <answer>\\boxed{4}</answer>")
    assert p_err([]) + p_format(n, bad, 1) == 0.5


def test_is_all_equal():
    assert is_all_equal([1, 1, 1]) and is_all_equal([0.0, 0.0]) and is_all_equal([7]) and is_all_equal([])
    assert not is_all_equal([1, 0, 1])


# ---------------------------------------------------------------- quotas
def test_quota_worked_example():
    # n = 16, keep = 8, 6 negatives: k_neg = round_half_down(6*8/16 = 3.0) = 3, k_pos = 8 - 3 = 5.
    assert quotas(6, 10, 8) == (3, 5)
    # 7 negatives: 7*8/16 = 3.5 -> half rounds down -> 3 = floor(7/2) (the release's round-half-even gives 4).
    assert quotas(7, 9, 8, min_pos=0, min_neg=0) == (3, 5)


def test_quota_min_guards():
    assert quotas(15, 1, 8) == (7, 1)      # 7.5 -> 7 negatives; the lone positive fits without a guard
    assert quotas(14, 2, 8) == (6, 2)      # 7 neg / 1 pos -> positive guard raises to min(2, 2) = 2
    assert quotas(30, 2, 16) == (14, 2)    # 15 neg / 1 pos -> positive guard raises to min(2, 2) = 2: 14 + 2
    assert quotas(1, 15, 8) == (1, 7)      # 0.5 -> 0 negatives -> negative guard raises to min(2, 1) = 1
    assert quotas(3, 13, 8) == (2, 6)      # floor(1.5) = 1 -> raised to 2
    assert quotas(1, 2, 2) == (1, 1)       # both guards cannot hold (need 1 + 2 > 2): proportional split


@pytest.mark.parametrize("keep", range(1, 21))
def test_quota_properties(keep):
    for n in range(keep, 2 * keep + 9):
        for n_neg in range(n + 1):
            k_neg, k_pos = quotas(n_neg, n - n_neg, keep)
            assert k_neg + k_pos == keep and 0 <= k_neg <= n_neg and 0 <= k_pos <= n - n_neg
            if n == 2 * keep:
                base = quotas(n_neg, n - n_neg, keep, min_pos=0, min_neg=0)
                assert base == (n_neg // 2, keep - n_neg // 2)    # paper: floor(|O_neg| / 2)


# ---------------------------------------------------------------- select_group
def _group(n_neg, n_pos, seed=0):
    rng = np.random.default_rng(seed)
    rewards = rng.permutation(np.r_[np.zeros(n_neg), np.ones(n_pos)])
    return rewards, rng.uniform(0, 2, size=n_neg + n_pos)


@pytest.mark.parametrize("mode", ["paper", "release"])
def test_select_6_negatives_10_positives(mode):
    rewards, pen = _group(6, 10)
    idx = select_group(rewards, pen, 8, np.random.default_rng(1), mode)
    assert len(idx) == 8 and len(set(idx)) == 8 and np.all(np.diff(idx) > 0)
    assert (rewards[idx] <= 0).sum() == 3 and (rewards[idx] > 0).sum() == 5


@pytest.mark.parametrize("mode", ["paper", "release"])
@pytest.mark.parametrize("n_neg, n_pos, exp_neg", [(0, 16, 0), (16, 0, 8), (15, 1, 7), (14, 2, 6), (1, 15, 1)])
def test_select_edge_groups(mode, n_neg, n_pos, exp_neg):
    rewards, pen = _group(n_neg, n_pos)
    idx = select_group(rewards, pen, 8, np.random.default_rng(2), mode)
    assert len(idx) == 8 and len(set(idx)) == 8 and (rewards[idx] <= 0).sum() == exp_neg


@pytest.mark.parametrize("mode", ["paper", "release"])
def test_select_zero_positive_quota_with_positives_present(mode):
    # n = 32, keep = 4, 3 positives, guards off: k_pos = round_half_up(3*4/32 = 0.375) = 0 -> only negatives.
    rewards = np.r_[np.zeros(29), np.ones(3)]
    idx = select_group(rewards, np.zeros(32), 4, np.random.default_rng(0), mode, min_pos=0, min_neg=0)
    assert len(idx) == 4 and (rewards[idx] <= 0).all()


def test_select_small_group_keeps_all():
    assert select_group([1, 0, 1], [0.1, 0.2, 0.3], 8, np.random.default_rng(0)).tolist() == [0, 1, 2]
    assert select_group(np.ones(8), np.zeros(8), 8, np.random.default_rng(0)).tolist() == list(range(8))
    assert select_group([], [], 8, np.random.default_rng(0)).tolist() == []


def test_select_no_tool_calls_and_ties():
    # Every positive is tool-free with a clean answer: identical penalties 0.5; selection still works.
    rewards = np.r_[np.ones(10), np.zeros(6)]
    pen = np.full(16, p_err([]) + p_format(1, False, 1))
    for mode in ("paper", "release"):
        assert len(select_group(rewards, pen, 8, np.random.default_rng(3), mode)) == 8


def test_release_mode_lowest_penalty_stable_ties():
    rewards = np.array([1, 0, 1, 1, 0, 1, 1, 1, 0, 1, 1, 0, 1, 0, 1, 0], float)   # 10 pos, 6 neg -> k_pos = 5
    pen = np.array([1.5, 9, 0.0, 1.0, 9, .5, .5, .5, 9, 0.0, 2.0, 9, .5, 9, 1.0, 9])
    idx = select_group(rewards, pen, 8, np.random.default_rng(0), "release")
    # Positives by penalty: 0.0 at 2, 9; then 0.5 at 5, 6, 7, 12 -> ties in rollout order: 5, 6, 7 (12 left out).
    assert [i for i in idx if rewards[i] > 0] == [2, 5, 6, 7, 9]


def test_paper_mode_first_pick_follows_inverse_penalty():
    # n = 12, keep = 4, 4 positives: k_neg = round_half_down(8*4/12 = 2.67) = 3, k_pos = 1 (min_pos=1).
    rewards = np.r_[np.zeros(8), np.ones(4)]
    pen = np.r_[np.zeros(8), [0.25, 0.5, 1.0, 2.0]]       # weights 4 : 2 : 1 : 0.5, sum 7.5
    expected = np.array([4, 2, 1, 0.5]) / 7.5            # 0.533, 0.267, 0.133, 0.067
    trials = 4000
    counts = np.zeros(4)
    for seed in range(trials):
        idx = select_group(rewards, pen, 4, np.random.default_rng(seed), "paper", min_pos=1)
        pos = [i - 8 for i in idx if i >= 8]
        assert len(pos) == 1
        counts[pos[0]] += 1
    # binomial sd <= sqrt(.25/4000) = 0.008; 0.03 is ~4 sd
    np.testing.assert_allclose(counts / trials, expected, atol=0.03)


def test_negatives_uniform():
    rewards, pen = _group(6, 10)
    neg = np.flatnonzero(rewards <= 0)
    pen[neg] = np.arange(6)                               # penalties must not matter for negatives
    trials, hits = 3000, np.zeros(16)
    for seed in range(trials):
        hits[select_group(rewards, pen, 8, np.random.default_rng(seed), "paper")] += 1
    # each negative is kept with probability k_neg / n_neg = 3 / 6; sd = sqrt(.25/3000) = 0.009
    np.testing.assert_allclose(hits[neg] / trials, 0.5, atol=0.04)


def test_deterministic_under_seed():
    rewards, pen = _group(7, 9)
    a = select_group(rewards, pen, 8, np.random.default_rng(42), "paper")
    b = select_group(rewards, pen, 8, np.random.default_rng(42), "paper")
    assert a.tolist() == b.tolist()


def test_bad_mode():
    with pytest.raises(ValueError):
        select_group(*_group(6, 10), 8, np.random.default_rng(0), mode="greedy")


# ---------------------------------------------------------------- roc_select over a flat batch
def _batch():
    # Three prompts of 16 rollouts, interleaved: "a" mixed (6 neg), "b" all correct, "c" all wrong.
    rng = np.random.default_rng(7)
    ra, pa = _group(6, 10, seed=1)
    gids = np.array(["a", "b", "c"] * 16)
    rewards = np.empty(48)
    rewards[gids == "a"], rewards[gids == "b"], rewards[gids == "c"] = ra, 1.0, 0.0
    pen = rng.uniform(0, 2, 48)
    return gids, rewards, pen


def test_roc_select_drops_all_equal():
    gids, rewards, pen = _batch()
    res = roc_select(gids, rewards, pen, 8, np.random.default_rng(0), "paper")
    assert res.kept == 8 and res.mask.sum() == 8 and res.dropped_groups == 2 and res.dropped_rollouts == 32
    assert set(gids[res.mask]) == {"a"}
    assert (rewards[res.mask] <= 0).sum() == 3          # same 3 / 5 split as the single-group case


def test_roc_select_keeps_all_equal_when_asked():
    gids, rewards, pen = _batch()
    res = roc_select(gids, rewards, pen, 8, np.random.default_rng(0), "release", drop_all_equal=False)
    assert res.kept == 24 and res.dropped_groups == 0 and res.dropped_rollouts == 0
    for g in "abc":
        assert (res.mask & (gids == g)).sum() == 8
    b = np.flatnonzero(gids == "b")                      # release mode: the 8 lowest penalties of group b
    assert set(np.flatnonzero(res.mask & (gids == "b"))) == set(b[np.argsort(pen[b], kind="stable")[:8]])


def test_roc_select_without_down_sampling_keeps_groups_whole():
    """keep=None (RoC off, plain GRPO): only the all-equal rule drops anything."""
    gids, rewards, pen = _batch()
    res = roc_select(gids, rewards, pen, None, np.random.default_rng(0))
    assert res.mask.tolist() == (gids == "a").tolist() and res.dropped_groups == 2 and res.dropped_rollouts == 32
    res = roc_select(gids, rewards, pen, None, np.random.default_rng(0), drop_all_equal=False)
    assert res.mask.all() and res.dropped_groups == 0


def test_roc_select_deterministic_and_empty():
    gids, rewards, pen = _batch()
    m1 = roc_select(gids, rewards, pen, 8, np.random.default_rng(5)).mask
    m2 = roc_select(gids, rewards, pen, 8, np.random.default_rng(5)).mask
    assert (m1 == m2).all()
    empty = roc_select([], [], [], 8, np.random.default_rng(0))
    assert empty.kept == 0 and empty.dropped_groups == 0 and empty.mask.shape == (0,)
