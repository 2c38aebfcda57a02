"""rstar2.run.plan: model-state figures equal DeepSpeed's estimators, the hand-worked activation and KV formulas, every
preset fits its own placement, and a run that cannot fit is refused before Ray or any actor starts."""

import pytest
import ray
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
from transformers import AutoModelForCausalLM

from rstar2.core import config
from rstar2.run import plan

# vocab 100, hidden 8, 1 layer, 2 heads of 4, 1 KV head, ffn 16 (Qwen2: q/k/v biases, tied embeddings)
SMALL = ["world.vocab_size=100", "world.hidden=8", "world.layers=1", "world.heads=2", "world.kv_heads=1",
         "world.ffn=16", "trainer.micro_batch_tokens=10", "engine.dtype=float32"]
# embedding 100*8 = 800; layer: q 8*8+8, k 8*4+4, v 8*4+4, o 8*8 = 208, MLP 3*8*16 = 384, two norms 16; final norm 8
PARAMS, LARGEST = 800 + 208 + 384 + 16 + 8, 800


def small(*more: str) -> config.RunCfg:
    return config.load("tiny", SMALL + list(more))


def test_shape_counts_the_real_model():
    s = plan.shape(plan.model_config(small()))
    assert (s.params, s.largest_layer) == (PARAMS, LARGEST)
    real = AutoModelForCausalLM.from_config(plan.model_config(small()))  # materialised, not meta
    assert sum(p.numel() for p in real.parameters()) == PARAMS


@pytest.mark.parametrize("stage,by_hand", [(3, 4 * 800 + 18 * 1416 // 2), (2, 2 * 1416 + 18 * 1416 // 2)])
def test_model_states_equal_deepspeeds_estimator(stage, by_hand):
    cfg = small("trainer.backend=deepspeed", f"trainer.zero_stage={stage}", "trainer.world_size=2")
    got = plan.model_states_bytes(plan.shape(plan.model_config(cfg)), cfg)
    if stage == 3:
        _, ds, _ = estimate_zero3_model_states_mem_needs(PARAMS, LARGEST, num_gpus_per_node=1, num_nodes=2,
                                                         cpu_offload=False, cpu_offload_params=False)
    else:
        _, ds = estimate_zero2_model_states_mem_needs(PARAMS, num_gpus_per_node=1, num_nodes=2, cpu_offload=False)
    assert got == ds == by_hand
    assert plan.model_states_bytes(plan.shape(plan.model_config(small())), small()) == 16 * PARAMS  # torch: fp32 + Adam


def test_activations_and_kv_by_hand():
    cfg = small()
    s = plan.shape(plan.model_config(cfg))
    per_layer = 4 * (4 * 8 + 3 * 8 + 4 * 4 + 4 * 16)  # fp32: 544 bytes a token
    assert plan.activation_bytes(s, cfg, checkpointing=False) == 10 * (per_layer + 100 * 12)
    assert plan.activation_bytes(s, cfg, checkpointing=True) == 10 * (4 * 8 + per_layer + 100 * 12)
    assert plan.kv_bytes_per_token(s, cfg) == 2 * 1 * 1 * 4 * 4  # K and V, 1 layer, 1 head of 4, fp32


@pytest.mark.parametrize("preset", config.list_presets())
def test_every_preset_fits_its_placement(preset):
    res = plan.require_fit(config.load(preset))
    assert res["fits"] and res["devices"]
    assert res["figures"]["trainer_gb"] > 0 and res["figures"]["kv_capacity_tokens"] > 0


def test_the_paper_preset_on_too_few_gpus_does_not_fit():
    cfg = config.load("qwen3-14b")
    assert plan.plan(cfg)["fits"]
    res = plan.plan(cfg, gpus=8)  # 64 ranks and 16 x TP4 engines want 64 GPUs
    assert not res["fits"] and all("needs 64 GPUs, has 8" in d["detail"] for d in res["devices"])
    small_gpu = plan.plan(config.load("gpu-8x80g", ["trainer.gradient_checkpointing=false"]))
    assert not small_gpu["fits"]  # ~78 GB of activations beside the model states


def test_an_impossible_run_is_refused_before_any_actor_starts(tmp_path, monkeypatch):
    from rstar2.flows.campaign import CampaignParams, campaign
    from rstar2.rollout import cluster
    joined, ray_before = [], ray.is_initialized()
    monkeypatch.setattr(cluster, "init", lambda: joined.append(True))  # where every Ray start goes through
    params = CampaignParams(preset="qwen3-14b", overrides=["placement.gpus=8", f"out_dir={tmp_path}"])
    with pytest.raises(plan.PlanError, match="does not fit 8 x 192 GB GPUs"):
        campaign.fn(params)
    assert not joined and ray.is_initialized() == ray_before
    assert not any(tmp_path.iterdir())  # not even a run directory


def test_plan_command_exit_codes(tmp_path):
    from typer.testing import CliRunner

    from rstar2.cli.main import app

    ok = CliRunner().invoke(app, ["plan", "--preset", "gpu-1x80g", "--json", str(tmp_path / "p.json")])
    assert ok.exit_code == 0, ok.output
    assert "fits" in ok.output and (tmp_path / "p.json").is_file()
    assert CliRunner().invoke(app, ["plan", "--preset", "gpu-1x80g", "--gpu-mem", "16"]).exit_code == 1
    refused = CliRunner().invoke(app, ["campaign", "--preset", "qwen3-14b", "--set", "placement.gpus=8"])
    assert refused.exit_code == 2 and "does not fit" in refused.output
