"""The per-step health line and the collapse alert (rstar2/evaluation/health.py) on recorded-style metric
trajectories."""

import logging

import pytest

from rstar2.evaluation.health import collapse_alert, first_collapse, health_line

# A collapse like a recorded run's: reward peaks at 0.43 at step 4, then format violations climb 0.12 -> 0.51 and
# tool errors 0.09 -> 0.69 by step 10.
#   step  reward  format_violation_rate  tool_error_rate
COLLAPSE = [
    (1, 0.30, 0.20, 0.15),
    (2, 0.35, 0.16, 0.12),
    (3, 0.40, 0.13, 0.10),
    (4, 0.43, 0.12, 0.09),
    (5, 0.41, 0.13, 0.11),
    (6, 0.37, 0.16, 0.15),
    (7, 0.31, 0.21, 0.17),
    (8, 0.26, 0.25, 0.26),
    (9, 0.20, 0.36, 0.40),
    (10, 0.14, 0.51, 0.69),
    (11, 0.11, 0.55, 0.72),
    (12, 0.09, 0.58, 0.74),
]
# A run that improves: rates fall with noise (tool errors blip 0.04 -> 0.07 at step 9: ×1.75, not ×2).
HEALTHY = [
    (1, 0.10, 0.40, 0.30),
    (2, 0.14, 0.33, 0.26),
    (3, 0.19, 0.30, 0.22),
    (4, 0.22, 0.24, 0.18),
    (5, 0.27, 0.21, 0.12),
    (6, 0.31, 0.17, 0.10),
    (7, 0.36, 0.15, 0.06),
    (8, 0.40, 0.12, 0.04),
    (9, 0.43, 0.13, 0.07),
    (10, 0.47, 0.10, 0.05),
    (11, 0.52, 0.09, 0.05),
    (12, 0.55, 0.08, 0.04),
]


def rows(table):
    return [{"step": s, "reward_mean": r, "format_violation_rate": f, "tool_error_rate": e} for s, r, f, e in table]


def alerts(table, **kw):
    """{step: what fired} over a run, the alert evaluated after each step on the history so far."""
    h = rows(table)
    return {h[i]["step"]: a for i in range(len(h)) if (a := collapse_alert(h[:i + 1], **kw))}


def test_collapse_fires_first_at_step_9_on_both_rates():
    got = alerts(COLLAPSE)
    # tool errors start at (0.15 + 0.12) / 2 = 0.135. Step 8: before the last two, 0.15 0.12 0.10 0.09 0.11 0.15:
    # |differences| 0.03 0.02 0.01 0.02 0.04, median 0.02, noise 1.4826 x 0.02 / sqrt 2 = 0.021; threshold
    # 0.135 + 2 x 0.021 = 0.177 > 0.17. Step 9: the same noise, the last two 0.26 0.40 both above.
    # Format starts at 0.18; step 8: 0.21 < 0.18 + 2 x 0.021; step 9: |differences| median 0.03, noise 0.031,
    # threshold 0.243 <= 0.25 0.36.
    both = ["format_violation_rate 0.18 -> 0.36 (noise 0.03)", "tool_error_rate 0.14 -> 0.40 (noise 0.02)"]
    assert min(got) == 9 and first_collapse(rows(COLLAPSE)) == (8, both)
    assert got[10] == ["format_violation_rate 0.18 -> 0.51 (noise 0.03)", "tool_error_rate 0.14 -> 0.69 (noise 0.02)"]
    assert sorted(got) == [9, 10, 11, 12]  # a collapse stays collapsed: the alert holds while the rates stay up


def test_healthy_run_never_fires():
    assert alerts(HEALTHY) == {} and first_collapse(rows(HEALTHY)) is None


def test_a_rise_below_the_start_or_for_one_step_never_fires_a_sustained_one_above_does():
    blip = [{"tool_error_rate": v} for v in (0.10, 0.11, 0.09, 0.10, 0.40, 0.10, 0.11)]
    assert [collapse_alert(blip[:i]) for i in range(1, 8)] == [None] * 7
    back = [{"tool_error_rate": v} for v in (0.20, 0.18, 0.10, 0.05, 0.04, 0.15, 0.18, 0.05)]  # up 4x, below 0.19
    assert [collapse_alert(back[:i]) for i in range(1, 9)] == [None] * 8
    rise = [{"tool_error_rate": v} for v in (0.10, 0.12, 0.09, 0.10, 0.40, 0.30)]
    # noise 1.4826 x median(0.02, 0.03, 0.01) / sqrt 2 = 0.021; start 0.11; 0.30 >= 0.11 + 2 x 0.021
    assert collapse_alert(rise) == ["tool_error_rate 0.11 -> 0.30 (noise 0.02)"]


def test_the_threshold_scales_with_the_runs_own_noise():
    quiet = [0.20, 0.22, 0.20, 0.22, 0.20]  # noise 1.4826 x 0.02 / sqrt 2 = 0.021: threshold 0.21 + 0.042
    noisy = [0.20, 0.30, 0.20, 0.30, 0.20]  # |differences| 0.10: noise 0.105, threshold 0.25 + 0.21
    assert collapse_alert([{"format_violation_rate": v} for v in quiet + [0.30, 0.30]]) == [
        "format_violation_rate 0.21 -> 0.30 (noise 0.02)"]
    assert collapse_alert([{"format_violation_rate": v} for v in noisy + [0.30, 0.30]]) is None
    assert collapse_alert([{"format_violation_rate": v} for v in noisy + [0.60, 0.60]]) == [
        "format_violation_rate 0.25 -> 0.60 (noise 0.10)"]


def test_smooth_runs_need_the_noise_floor_to_be_crossed():
    h = [{"tool_error_rate": v} for v in (0.10, 0.10, 0.10, 0.10, 0.13, 0.13)]  # noise 0 -> 0.02: threshold 0.14
    assert collapse_alert(h) is None
    h[-2:] = [{"tool_error_rate": 0.14}, {"tool_error_rate": 0.14}]
    assert collapse_alert(h) == ["tool_error_rate 0.10 -> 0.14 (noise 0.02)"]
    assert collapse_alert(h, noise_floor=0.03) is None


def test_missing_metrics_and_short_histories_never_fire():
    assert collapse_alert([]) is None
    assert collapse_alert([{"tool_error_rate": v} for v in (0.0, 0.0, 0.0, 0.9)]) is None  # 2 steps before the last 2
    assert collapse_alert([{"reward_mean": 0.4}] * 6 + [{"tool_error_rate": 0.5}]) is None
    h = [{"tool_error_rate": v} for v in (0.10, 0.10, 0.10, 0.40)] + [{"reward_mean": 0.4}, {"tool_error_rate": 0.4}]
    assert collapse_alert(h) == ["tool_error_rate 0.10 -> 0.40 (noise 0.02)"]  # a step without it is left out


def test_health_line():
    m = {"reward_mean": 0.3125, "format_violation_rate": 0.25, "tool_error_rate": 0.4219, "response_len_mean": 811.6,
         "grad_norm": 0.8412, "clip_frac_high": 0.0123, "clip_frac_low": 0.0031, "entropy": 1.2345, "lr": 5e-4}
    assert health_line(m, 7) == ("step 7 | reward 0.312 | fmt-viol 0.250 | tool-err 0.422 | len 812 | grad 0.841 | "
                                 "clip-hi 0.012 | clip-lo 0.003 | entropy 1.234")
    assert health_line({"reward_mean": 0.5, "entropy": float("nan")}, 1) == (
        "step 1 | reward 0.500 | fmt-viol - | tool-err - | len - | grad - | clip-hi - | clip-lo - | entropy -")


@pytest.mark.parametrize("table", [COLLAPSE, HEALTHY])
def test_every_step_prints_one_line(table):
    assert all("\n" not in health_line(r, r["step"]) for r in rows(table))


def test_log_step_task_logs_and_tags_the_first_alert_again_after_a_resume(tmp_path, monkeypatch):
    """The stage flow's log-step task, run step by step on COLLAPSE (global steps 100 + stage step): one health line
    per step, the metric collapse_alert 0/1 and the step's metrics on the stage run, the headline on the campaign
    run, the tags naming the first firing; a resumed stage (history rebuilt from the committed manifests, here steps
    1-9, then step 10 runs) recomputes the same tags."""
    from rstar2.core import tracking
    from rstar2.tasks import costs
    from rstar2.tasks.track import log_step

    # the track logger's records, caught on it: importing Prefect (above, in the first test to do so) sets the root
    # logger's handlers anew, so pytest's caplog, on the root, would miss them
    seen: list[logging.LogRecord] = []
    catch = logging.Handler()
    catch.emit = seen.append
    track_log = logging.getLogger("rstar2.tasks.track")
    monkeypatch.setattr(track_log, "handlers", [catch])
    monkeypatch.setattr(track_log, "level", logging.INFO)

    def lines() -> list[tuple[str, str]]:  # (level, text) of each record so far
        return [(r.levelname, r.getMessage()) for r in seen]

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    exp = tracking.setup("health", str(tmp_path))
    campaign = tracking.create_run(exp, "campaign")
    run_id = tracking.create_run(exp, "stage-s1", campaign)
    h = rows(COLLAPSE)
    since = costs.mark()
    for i in range(9):
        cost, since = log_step.fn(h[:i + 1], 100, "s1", (run_id, campaign), since)
        assert 0.0 <= cost["orchestration_overhead_frac"] <= 1.0
    out = lines()
    assert out[0][0] == "INFO" and out[0][1].startswith("[s1] step 101 | reward 0.300 | fmt-viol 0.200 | tool-err "
                                                          "0.150 | len - |")
    assert out[-2:] == [("INFO", "[s1] step 109 | reward 0.200 | fmt-viol 0.360 | tool-err 0.400 | len - | grad - | "
                                 "clip-hi - | clip-lo - | entropy -"),
                        ("WARNING", "[s1] ALERT collapse at step 109: format_violation_rate 0.18 -> 0.36 (noise 0.03); "
                                    "tool_error_rate 0.14 -> 0.40 (noise 0.02)")]
    tags = {"alert.collapse": "step 109: format_violation_rate 0.18 -> 0.36 (noise 0.03); tool_error_rate 0.14 -> 0.40 "
                              "(noise 0.02)", "alert.collapse_step": "109"}
    tracking.client().delete_tag(run_id, "alert.collapse")  # as if the run died after step 9's commit, before tagging
    log_step.fn(h[:10], 100, "s1", (run_id, campaign), since)
    assert lines()[-1] == ("WARNING", "[s1] ALERT collapse at step 110: format_violation_rate 0.18 -> 0.51 (noise "
                                      "0.03); tool_error_rate 0.14 -> 0.69 (noise 0.02)")
    client = tracking.client()
    assert {k: client.get_run(run_id).data.tags.get(k) for k in tags} == tags
    history = lambda run, key: sorted((m.step, m.value) for m in client.get_metric_history(run, key))  # noqa: E731
    assert history(run_id, "collapse_alert") == [(100 + s, float(s >= 9)) for s in range(1, 11)]
    assert history(run_id, "tool_error_rate") == [(100 + s, r["tool_error_rate"]) for s, r in enumerate(h[:10], 1)]
    assert [s for s, _ in history(run_id, "orchestration_overhead_frac")] == list(range(101, 111))
    assert history(campaign, "reward_mean") == [(100 + s, r["reward_mean"]) for s, r in enumerate(h[:10], 1)]
    assert "collapse_alert" not in client.get_run(campaign).data.metrics
