"""Stage transitions: the plateau test on hand-worked curves."""

import pytest

from rstar2.core.config import PlateauCfg
from rstar2.training.transition import decide, window_gain

CFG = PlateauCfg(metric="reward_mean", window=2, min_delta=0.05, min_steps=4)


def test_window_gain_compares_the_last_window_with_the_one_before():
    assert window_gain([0.1, 0.2, 0.3, 0.5], 2) == pytest.approx(0.4 - 0.15)
    assert window_gain([0.1, 0.2, 0.3], 2) is None  # needs 2w values


def test_a_rising_curve_continues_and_a_flat_one_advances_as_plateau():
    rising = [0.1, 0.2, 0.3, 0.4, 0.5]
    assert decide(rising, 5, 10, CFG).advance is False
    flat = [0.1, 0.3, 0.40, 0.42, 0.41, 0.43]  # last two mean 0.42 vs 0.41 before: +0.01 < 0.05
    d = decide(flat, 6, 10, CFG)
    assert (d.advance, d.reason) == (True, "plateau")
    assert d.evidence["window_gain"] == pytest.approx(0.01) and d.evidence["last"] == [0.41, 0.43]


def test_no_plateau_before_min_steps_and_the_budget_always_ends_a_stage():
    assert decide([0.3, 0.3, 0.3, 0.3], 3, 10, CFG).advance is False  # flat, but only 3 steps done (min 4)
    assert decide([0.1, 0.9], 10, 10, CFG).reason == "budget"
    assert decide([], 0, 0, None).reason == "budget"  # an empty stage ends at once
    assert decide([0.5] * 20, 9, 10, None).advance is False  # no plateau rule: run the whole budget
