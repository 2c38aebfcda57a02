"""Statistics (rstar2/evaluation/stats.py) against values worked by hand."""

import math

import pytest

from rstar2.evaluation import stats


def test_pass_at_k_is_the_unbiased_estimator():
    # n=4 samples, c=2 correct: pass@1 = 2/4; pass@2 = 1 - C(2,2)/C(4,2) = 1 - 1/6; pass@4: n-c=2 < 4, always hit
    assert stats.pass_at_k(4, 2, 1) == pytest.approx(0.5)
    assert stats.pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)
    assert stats.pass_at_k(4, 2, 4) == 1.0
    # n=5, c=1, k=2: 1 - C(4,2)/C(5,2) = 1 - 6/10
    assert stats.pass_at_k(5, 1, 2) == pytest.approx(0.4)
    assert stats.pass_at_k(4, 0, 2) == 0.0 and stats.pass_at_k(4, 4, 1) == 1.0
    # stable for large n: n=1000, c=1, k=1 is 1/1000
    assert stats.pass_at_k(1000, 1, 1) == pytest.approx(1e-3)
    with pytest.raises(ValueError):
        stats.pass_at_k(4, 2, 5)
    assert stats.ks_upto(4) == [1, 2, 4] and stats.ks_upto(6) == [1, 2, 4] and stats.ks_upto(1) == [1]


def test_pass1_and_its_standard_error_are_clustered_by_problem():
    # per-problem means [0, 1, 0.5, 0.5]: pass@1 0.5; deviations -0.5, 0.5, 0, 0: SS 0.5, var 0.5/3, SE sqrt(1/6)/2
    pass1, se = stats.pass1_with_se([[0, 0], [1, 1], [1, 0], [0, 1]])
    assert pass1 == pytest.approx(0.5) and se == pytest.approx(math.sqrt(0.5 / 3) / 2)  # 0.20412
    # the same 8 samples as 8 independent problems would claim a smaller SE: sd 0.5345 / sqrt(8) = 0.1890
    assert stats.pass1_with_se([[r] for r in [0, 0, 1, 1, 1, 0, 0, 1]])[1] == pytest.approx(0.18898, abs=1e-5)
    assert math.isnan(stats.pass1_with_se([[1, 0]])[1])  # one problem: no spread


def test_evaluation_stats_report_pass_at_k_up_to_the_samples():
    ev = stats.evaluation_stats([[0, 0], [1, 1], [1, 0], [0, 1]])
    # pass@2 per problem: 0, 1, 1, 1 (n-c=1 < 2 for the mixed ones) -> 0.75
    assert ev == pytest.approx({"pass1": 0.5, "pass1_se": 0.2041241, "pass_at_1": 0.5, "pass_at_2": 0.75,
                                "problems": 4, "samples": 2})


def test_t_quantiles_match_the_table():
    # the two-sided 95 % column of a printed t table
    for df, t in [(1, 12.706), (2, 4.303), (3, 3.182), (4, 2.776), (9, 2.262), (30, 2.042), (1000, 1.962)]:
        assert stats.t_quantile(df) == pytest.approx(t, abs=1e-3), df


def test_seed_summary_over_a_recorded_table():
    # three seeds' gains 0.1, 0.2, 0.3: mean 0.2, sd 0.1, half width t(2) * 0.1 / sqrt(3) = 4.3027 * 0.057735
    s = stats.seed_summary([0.1, 0.3, 0.2])
    assert (s["mean"], s["min"], s["max"], s["n"]) == (pytest.approx(0.2), 0.1, 0.3, 3)
    assert s["sd"] == pytest.approx(0.1) and s["half_width"] == pytest.approx(0.248414, abs=1e-5)
    assert s["ci95"] == pytest.approx([0.2 - 0.248414, 0.2 + 0.248414], abs=1e-5)
    one = stats.seed_summary([0.42])
    assert one["ci95"] == [0.42, 0.42] and math.isnan(one["half_width"]) and one["n"] == 1


def test_compare_is_welch_and_says_whether_a_difference_is_beyond_noise():
    # equal variances 0.01 and n=3 each: s2 = 2 * 0.01/3, df = 4, half = 2.7764 * 0.08165 = 0.22670
    c = stats.compare([0.5, 0.6, 0.7], [0.1, 0.2, 0.3])
    assert c["diff"] == pytest.approx(0.4) and c["df"] == pytest.approx(4.0)
    assert c["ci95"] == pytest.approx([0.4 - 0.22670, 0.4 + 0.22670], abs=1e-4) and c["beyond_noise"] is True
    # n=2 each, variances 0.02: s2 = 0.02, df = 2, half = 4.3027 * 0.141421 = 0.60849: includes 0
    c = stats.compare([0.2, 0.4], [0.1, 0.3])
    assert c["diff"] == pytest.approx(0.1) and c["df"] == pytest.approx(2.0)
    assert c["ci95"] == pytest.approx([0.1 - 0.60849, 0.1 + 0.60849], abs=1e-4) and c["beyond_noise"] is False
    one = stats.compare([0.5], [0.1, 0.2])  # one seed: no interval, never beyond noise
    assert one["ci95"] is None and one["beyond_noise"] is False and one["diff"] == pytest.approx(0.35)


def test_curve_band_averages_the_seeds_that_logged_each_step():
    band = stats.curve_band([[(1, 0.2), (2, 0.4)], [(1, 0.4)], [(2, 0.6), (1, 0.3)]])
    want = [(1, 0.3, 0.2, 0.4, 3), (2, 0.5, 0.4, 0.6, 2)]
    assert len(band) == 2 and all(got == pytest.approx(w) for got, w in zip(band, want))


def test_an_evaluation_reports_its_statistics_from_the_scored_samples(tmp_path):
    import polars as pl

    from rstar2.run import steps
    uri = tmp_path / "eval.parquet"
    pl.DataFrame({"problem_id": ["a", "a", "b", "b", "c", "c", "d", "d"], "reward": [0.0, 0, 1, 1, 1, 0, 0, 1],
                  "response_len": [10] * 8}).write_parquet(uri)
    ev = steps.eval_stats(str(uri))
    assert ev == pytest.approx({"pass1": 0.5, "pass1_se": 0.2041241, "pass_at_1": 0.5, "pass_at_2": 0.75,
                                "problems": 4, "samples": 2, "response_len_mean": 10.0})


def test_paired_log_ratio_by_hand():
    # rates of the AVX-512 host: RoC 0.014 0.005 0.009, plain GRPO 0.170 0.062 0.039 (+ 0.005 each):
    # ln(0.019/0.175) = -2.2203, ln(0.010/0.067) = -1.9021, ln(0.014/0.044) = -1.1451; mean -1.7558, sd 0.5524,
    # half width t(2) 0.5523 / sqrt 3 = 4.302653 x 0.31888 = 1.37205
    c = stats.paired_log_ratio([0.014, 0.005, 0.009], [0.170, 0.062, 0.039])
    assert c["n"] == 3 and c["ratio"] == pytest.approx(math.exp(-1.7558), rel=1e-3)
    assert c["ci95"] == pytest.approx([math.exp(-1.7558 - 1.37205), math.exp(-1.7558 + 1.37205)], rel=2e-3)
    assert c["lower"] and not c["higher"]
    same = stats.paired_log_ratio([0.1, 0.2], [0.1, 0.2])  # every ratio 1: the interval is [1, 1]
    assert same["ratio"] == pytest.approx(1.0) and same["ci95"] == pytest.approx([1.0, 1.0]) and not same["lower"]
    assert stats.paired_log_ratio([0.0], [0.1])["ci95"] is None  # one pair: no interval
    with pytest.raises(ValueError, match="one b per a"):
        stats.paired_log_ratio([0.1, 0.2], [0.1])
