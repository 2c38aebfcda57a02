"""One RL step through the real flows on a GPU: a random Qwen3 of Qwen3-0.6B's shape is SFT'd on a few transcripts, then
a CUDA vLLM engine rolls out and a DeepSpeed ZeRO-2 trainer (bf16, gradient checkpointing) updates, colocated on the
GPU (the engine sleeps during the update), and the new weights reach the engine from memory. The data, suites and
transcripts are the own-model flow test's (tests/flows/test_own_model.py)."""

import json
from pathlib import Path

import mlflow
import polars as pl
import pytest
from typer.testing import CliRunner

from rstar2.core import checkpoint
from tests.flows.test_own_model import AIME, _jsonl, dapo_rows, transcripts

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("vllm_cuda")]

GPU = ["engine.gpu_memory_utilization=0.3", "engine.dtype=bfloat16", "placement.colocate=true",
       "trainer.backend=deepspeed", "trainer.zero_stage=2", "trainer.dtype=bfloat16", "trainer.lr=1.0e-6",
       "trainer.gradient_checkpointing=true", "trainer.weight_sync=memory", "trainer.micro_batch_tokens=4096"]


@pytest.fixture(scope="module", autouse=True)
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):  # as tests/flows/conftest.py: a temporary server
        yield


def test_one_rl_step_on_a_cuda_engine_and_a_deepspeed_trainer(tmp_path, qwen06b, figures):
    from rstar2.cli.main import app
    from rstar2.flows.campaign import CampaignParams, campaign

    runs, train = tmp_path / "runs", tmp_path / "train.parquet"
    suite = f"eval.suites=[{{name: aime, path: {_jsonl(tmp_path / 'aime.jsonl', AIME)}, answer_type: integer}}]"
    res = CliRunner().invoke(app, ["data", "import", _jsonl(tmp_path / "dapo.jsonl", dapo_rows()), "--out", str(train),
                                   "--set", suite, "--set", f"out_dir={runs}"])
    assert res.exit_code == 0, res.output
    overrides = [f"out_dir={runs}", f"world.base_model={qwen06b}", f"world.train_data={train}",
                 f"sft.data={_jsonl(tmp_path / 'sft.jsonl', transcripts())}", "sft.epochs=1", "sft.batch_tokens=512",
                 suite, "eval.samples=2", "eval.max_turns=2", "eval.max_response_tokens=64",
                 "rollout.group_size=4", "rollout.max_turns=2", "rollout.max_response_tokens=64",
                 "stages=[{name: rl, steps: 1, prompts_per_step: 4}]",
                 "roc.drop_all_equal=false", "trainer.tis_cap=2.0", *GPU]  # a random model's rewards are all 0
    summary = campaign(CampaignParams(preset="tiny", overrides=overrides, run_name="gpu"))

    run = runs / "gpu"
    final = Path(summary["final_checkpoint"])
    assert summary["steps"] == 1 and final == run / "checkpoints" / "rl" / "step-0001"
    assert checkpoint.is_committed(final)
    rollouts = pl.read_parquet(run / "rl" / "step-0000" / "rollouts.parquet")
    assert rollouts.height == 4 * 2 * 4  # prompts x RoC's 2G draws
    assert all(len(lp) == n and max(lp) <= 0.0 for lp, n in rollouts.select("response_logprobs", "response_len").rows())
    client = mlflow.MlflowClient(f"sqlite:///{runs / 'mlflow.db'}")
    exp = client.get_experiment_by_name("rstar2-tiny").experiment_id
    stage = client.search_runs([exp], "attributes.run_name = 'stage-rl'")[0].data.metrics
    assert stage["update_tokens"] > 0 and not stage.get("skipped")
    figures("rl_step_0.44b", {k: stage[k] for k in ("step_s", "update_s", "update_tokens") if k in stage})
    assert json.loads((final / "config.json").read_text())["model_type"] == "qwen3"
