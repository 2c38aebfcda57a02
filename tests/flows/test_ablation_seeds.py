"""The ablation's report over seeds (flow `ablation` under the Prefect test harness, a real MLflow store): each
variant's campaign is replaced by a recorded one (per-seed pass@1 and a per-step curve per seed), so the test checks
how the report composes the seeds in seconds; the seed axis itself runs for real in test_seeds.py."""

import json
from pathlib import Path

import mlflow
import pytest

from rstar2.core import config, tracking
from rstar2.evaluation import report

SFT = {"pass1": 0.40, "pass1_se": 0.03, "pass_at_1": 0.40, "pass_at_2": 0.55}
RECORDED = {"roc": [0.50, 0.55, 0.45], "plain-grpo": [0.30, 0.31, 0.29]}  # pass@1 after RL, rl_seed 0, 1, 2


def recorder(out, calls: list):
    """A stand-in for the campaign flow: the variant's recorded seeds as MLflow runs under `out`; keeps its params."""
    def recorded_campaign(params):
        cfg = config.load(params.preset, params.overrides)
        exp = tracking.setup(cfg.experiment, cfg.out_dir)
        parent = tracking.create_run(exp, params.run_name, tags={"kind": "campaign", "ablation": cfg.ablation})
        by_seed, shift = [], -0.1 * cfg.seed  # world seed w: every pass@1 0.1 w lower, its SFT model's as well
        sft = {k: v + shift for k, v in SFT.items() if k != "pass1_se"} | {"pass1_se": SFT["pass1_se"]}
        for s, v in enumerate(v + shift for v in RECORDED[cfg.ablation]):
            seed_run = tracking.create_run(exp, f"seed-{s}", parent, {"kind": "seed", "rl_seed": str(s)})
            stage_run = tracking.create_run(exp, "stage-stage1", seed_run)
            tracking.log_metrics(stage_run, {"reward_mean": v / 2, "tool_error_rate_pos": 1 - v}, 1)
            by_seed.append({"rl_seed": s, "mlflow_run_id": seed_run, "steps": 1, "pass1": v, "pass1_se": 0.02,
                            "pass_at_1": v, "pass_at_2": v + 0.1})
        calls.append(params)
        return {**report.seed_aggregate(sft, by_seed), "run_dir": str(out / params.run_name), "steps": 1,
                "wall_s": 5.0}
    return recorded_campaign


def test_the_ablation_reports_each_variant_over_seeds_against_the_first(tmp_path, monkeypatch):
    from rstar2.flows import ablation as flow

    out = tmp_path / "runs"
    calls = []
    monkeypatch.setattr(flow, "campaign", recorder(out, calls))
    res = flow.ablation(flow.AblationParams(preset="tiny", variants=["roc", "plain-grpo"], overrides=[f"out_dir={out}"],
                                            name="abl", seeds=3, world_seeds=1))
    assert [p.seeds for p in calls] == [3, 3] and calls[1].sft_checkpoint == str(out / "abl-roc" / "sft")
    roc, plain = res["variants"]
    assert (roc["pass1_rl"], roc["pass1_rl_min"], roc["pass1_rl_max"], roc["gain"]) == (0.5, 0.45, 0.55, 0.1)
    # plain-grpo - roc = -0.20; Welch: s2 = 0.0001/3 + 0.0025/3, df 2.16, the interval stays below 0
    (vs,) = res["comparisons"]
    assert (vs["variant"], vs["baseline"], vs["diff"], vs["beyond_noise"]) == ("plain-grpo", "roc", -0.2, True)
    assert vs["ci95"][1] < 0 and vs["seeds"] == [3, 3]
    # the per-step rows are the seeds' means: reward 0.25 (roc), 0.15 (plain-grpo) at step 1
    assert {(r["variant"], r["step"], r["reward_mean"]) for r in res["per_step"]} == {("roc", 1, 0.25),
                                                                                     ("plain-grpo", 1, 0.15)}
    # the end-of-RL figures per variant with their interval over seeds: tool-error rate 1 - pass@1 as recorded,
    # roc 0.5 +- 0.1242 (sd 0.05), plain-grpo 0.7 +- 0.0248 (sd 0.01): the intervals are apart
    ter = res["last_steps"]["variants"]["roc"]["tool_error_rate_pos"]
    assert (ter["mean"], ter["min"], ter["max"], ter["ci95"]) == (0.5, 0.45, 0.55, [0.3758, 0.6242])
    assert res["last_steps"]["vs_baseline"]["plain-grpo"]["tool_error_rate_pos"]["intervals_apart"] is True
    client = mlflow.MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    run = client.get_run(res["mlflow_run_id"])
    assert run.data.tags["seeds"] == "3" and run.data.metrics["plain-grpo_minus_roc"] == pytest.approx(-0.2)
    assert run.data.metrics["roc_pass1_rl_min"] == pytest.approx(0.45)
    logged = json.loads(Path(client.download_artifacts(run.info.run_id, "ablation.json")).read_text())
    assert logged["comparisons"] == res["comparisons"] and logged["variants"] == res["variants"]
    assert logged["last_steps"] == res["last_steps"] and run.data.metrics["roc_last_tool_error_rate_pos_max"] == 0.55
    assert {a.path for a in client.list_artifacts(run.info.run_id, "plots")} >= {"plots/reward_mean.png"}



def test_with_sft_off_no_variant_is_handed_a_sft_model_that_does_not_exist(tmp_path, monkeypatch):
    """Each variant then starts RL from its own world's initial model (runstate.sft_model), not `<first run>/sft`."""
    from rstar2.flows import ablation as flow

    out, calls = tmp_path / "runs", []
    monkeypatch.setattr(flow, "campaign", recorder(out, calls))
    flow.ablation(flow.AblationParams(preset="tiny", variants=["roc", "plain-grpo"], name="off", world_seeds=1,
                                      overrides=[f"out_dir={out}", "sft.enabled=false"]))
    assert [p.sft_checkpoint for p in calls] == [None, None]


def test_over_two_worlds_each_world_shares_its_own_sft_model_and_the_runs_are_pooled_pair_by_pair(tmp_path,
                                                                                                   monkeypatch):
    """The default ablation: 2 worlds (seed 0, 1), each variant's 3 seeds per world, 6 runs a variant; run i of
    every variant comes from one world's SFT model and one rl_seed, so the paired tool-error ratio has 6 pairs."""
    from rstar2.flows import ablation as flow

    out, calls = tmp_path / "runs", []
    monkeypatch.setattr(flow, "campaign", recorder(out, calls))
    res = flow.ablation(flow.AblationParams(preset="tiny", variants=["roc", "plain-grpo"], name="w",
                                            overrides=[f"out_dir={out}"]))
    assert [(p.run_name, p.sft_checkpoint) for p in calls] == [
        ("w-world-0-roc", None), ("w-world-0-plain-grpo", str(out / "w-world-0-roc" / "sft")),
        ("w-world-1-roc", None), ("w-world-1-plain-grpo", str(out / "w-world-1-roc" / "sft"))]
    assert ["seed=1" in p.overrides for p in calls] == [False, False, True, True]
    roc, plain = res["variants"]
    # roc: world 0 gains 0.10, 0.15, 0.05 from SFT 0.40; world 1 the same from its SFT 0.30
    assert roc["seeds"] == 6 and roc["pass1_sft"] == pytest.approx(0.35) and roc["gain"] == pytest.approx(0.1)
    assert (roc["pass1_rl_min"], roc["pass1_rl_max"]) == (pytest.approx(0.35), pytest.approx(0.55))
    # tool-error rate 1 - pass@1: roc/plain per pair 0.5/0.7, 0.45/0.69, 0.55/0.71, then 0.6/0.8, 0.55/0.79, 0.65/0.81
    ter = res["last_steps"]["vs_baseline"]["plain-grpo"]["tool_error_rate_pos"]
    assert ter["paired_ratio"]["higher"] is True and res["world_seeds"] == [0, 1]
    assert res["last_steps"]["variants"]["roc"]["tool_error_rate_pos"]["by_seed"] == pytest.approx(
        [0.5, 0.45, 0.55, 0.6, 0.55, 0.65])

