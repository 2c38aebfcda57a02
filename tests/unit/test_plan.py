"""rstar2.run.plan: model-state figures equal DeepSpeed's estimators, the hand-worked activation and KV formulas, every
preset fits its own placement, and a run that cannot fit is refused before Ray or any actor starts. LoRA: the figures
by hand, beside DeepSpeed's estimator, and against the bytes a peft-wrapped model holds after one AdamW step."""

import json

import pytest
import ray
import torch
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
from peft.tuners.lora import LoraLayer
from transformers import AutoModelForCausalLM, LlamaConfig

from rstar2.core import adapter, config
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


# LoRA (trainer.lora): the frozen base, the adapters, the engines' LoRA buffers. SMALL's adapted linear layers by hand:
# q 8->8 (+8 bias), k 8->4 (+4), v 8->4 (+4), o 8->8, gate 8->16, up 8->16, down 16->8; the tied LM head is left out
LORA = ["trainer.dtype=bfloat16", "trainer.lora.rank=2"]
ADAPTED = 192 + 384  # the attention's and the MLP's weights (their biases stay fp32)
ADAPTERS = 2 * ((8 + 8) + (8 + 4) + (8 + 4) + (8 + 8) + (8 + 16) + (8 + 16) + (16 + 8))  # rank x (in + out): 256


def test_lora_figures_by_hand():
    cfg = small(*LORA, "trainer.kl_coef=0.1")
    s = plan.shape(plan.model_config(cfg))
    targets = plan.lora_targets(s, cfg.trainer.lora)
    assert len(targets) == 7 and plan.lora_params(targets, 2) == ADAPTERS == 256
    assert plan.frozen_base_bytes(s, targets, cfg) == 2 * ADAPTED + 4 * (PARAMS - ADAPTED)  # bf16 + fp32: 4512
    assert plan.model_states_bytes(s, cfg) == 4512 + 16 * 256
    assert plan.reference_bytes(s, cfg) == 0  # the reference is the base with the adapter off
    per_layer = 2 * (4 * 8 + 3 * 8 + 4 * 4 + 4 * 16) + 2 * 2 * 7  # bf16; + rank 2 x 7 adapted layers
    assert plan.activation_bytes(s, cfg, checkpointing=False) == 10 * (per_layer + 100 * (2 + 8))
    # engine (fp32 in SMALL) at vLLM's rank 8 (rank 2 rounded up): every linear but the head, both embeddings
    # (2 x rank x (vocab + hidden)), punica's index tensors
    assert plan.engine_lora_rank(cfg) == 8
    assert plan.engine_lora_bytes(s, cfg) == (4 * 256 + 2 * 8 * (100 + 8)) * 4 + 48 * 16384
    tp2 = plan.engine_lora_bytes(s, small(*LORA, "engine.tensor_parallel_size=2"))  # o_proj, down_proj split their in
    assert tp2 == (8 * ((8 + 4) + (8 + 2) + (8 + 2) + (4 + 8) + (8 + 8) + (8 + 8) + (8 + 8)) + 1728) * 4 + 48 * 16384
    named = small(*LORA, "trainer.lora.targets=[q_proj, self_attn.v_proj]")  # peft's rule: the name's last parts
    assert [t.name for t in plan.lora_targets(s, named.trainer.lora)] == ["model.layers.0.self_attn.q_proj",
                                                                          "model.layers.0.self_attn.v_proj"]
    assert plan.model_states_bytes(s, named) == 2 * (64 + 32) + 4 * (PARAMS - 64 - 32) + 16 * 2 * (16 + 12)
    f = plan.plan(cfg)["figures"]
    assert (f["lora_params"], f["lora_adapted_layers"], f["trainer_reference_gb"]) == (256, 7, 0)
    assert f["trainer_model_states_gb"] == pytest.approx(f["trainer_frozen_base_gb"] + f["trainer_adapter_states_gb"])
    assert "lora_params" not in plan.plan(small())["figures"]


def test_lora_targets_naming_no_linear_layer_are_refused():
    cfg = small(*LORA, "trainer.lora.targets=[q_proj, qproj, embed_tokens]")
    with pytest.raises(plan.PlanError, match=r"\['qproj', 'embed_tokens'\] name no linear layer.*q_proj"):
        plan.plan(cfg)


def test_adapter_states_beside_deepspeeds_estimator():
    f = plan.plan(config.load("qwen3-14b-lora"))["figures"]
    n = f["lora_params"]
    assert n == 40 * 32 * (2 * (5120 + 5120) + 2 * (5120 + 1024) + 3 * (5120 + 17408))  # rank 32 on 7 x 40 layers
    _, ds = estimate_zero2_model_states_mem_needs(n, num_gpus_per_node=1, cpu_offload=False)
    assert f["trainer_adapter_states_deepspeed_gb"] * plan.GIB == ds == 20 * n  # + 16-bit weights and gradients
    assert f["trainer_adapter_states_gb"] * plan.GIB == 16 * n


def _measured_lora_bytes(mc, lora, dtype=torch.bfloat16) -> tuple[int, int]:
    """Bytes of every parameter, gradient and AdamW state tensor of `mc` (fp32) wrapped with peft's LoRA as the
    trainer wraps it (rstar2.core.adapter.attach: the adapted layers' weights held in `dtype`), after one
    forward/backward under autocast and one AdamW step on the adapter; and peft's own trainable count."""
    torch.manual_seed(0)
    model = adapter.attach(AutoModelForCausalLM.from_config(mc), lora, "from-config", frozen_dtype=dtype)
    assert all(m.get_base_layer().weight.dtype == dtype for m in model.modules() if isinstance(m, LoraLayer))
    ids = torch.randint(0, mc.vocab_size, (1, 16))
    with torch.autocast("cpu", dtype=dtype):
        model(input_ids=ids, labels=ids).loss.backward()
    opt = torch.optim.AdamW(adapter.trainable(model), lr=1e-4)
    opt.step()
    size = lambda t: t.numel() * t.element_size()  # noqa: E731
    params = sum(size(p) + (size(p.grad) if p.grad is not None else 0) for p in model.parameters())
    states = sum(size(v) for st in opt.state.values() for v in st.values() if torch.is_tensor(v))  # exp_avg(_sq), step
    return params + states, model.get_nb_trainable_parameters()[0]


# SmolLM2-135M's config.json (tied embeddings)
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)


@pytest.mark.filterwarnings("ignore:The PEFT config's `base_model_name_or_path`")  # a model from a config has none
@pytest.mark.parametrize("model,targets", [("tiny", "all-linear"), ("tiny", "[q_proj, v_proj, down_proj]"),
                                           ("smollm2-135m", "all-linear")])
def test_lora_model_states_match_a_measured_peft_model(model, targets):
    cfg = config.load("tiny", ["trainer.dtype=bfloat16", "trainer.lora.rank=16", f"trainer.lora.targets={targets}"])
    mc = plan.model_config(cfg) if model == "tiny" else LlamaConfig(**SMOLLM2_135M)
    s = plan.shape(mc)
    targets = plan.lora_targets(s, cfg.trainer.lora)
    measured, trainable = _measured_lora_bytes(mc, cfg.trainer.lora)
    assert plan.lora_params(targets, 16) == trainable  # peft's own count
    planned = plan.model_states_bytes(s, cfg)
    assert measured == planned + 4 * 2 * len(targets)  # all that differs: AdamW's fp32 `step` per A and per B tensor
    assert measured == pytest.approx(planned, rel=1e-4)


def test_the_lora_preset_fits_one_80gb_gpu_and_full_weights_do_not():
    lora = plan.plan(config.load("qwen3-14b-lora"), gpus=1, gpu_mem_gb=80)
    assert lora["fits"] and [d["kind"] for d in lora["devices"]] == ["colocated (update)", "colocated (rollout)"]
    f = lora["figures"]
    assert f["engine_weights_gb"] * plan.GIB == 2 * f["params"] and f["concurrent_sequences"] >= 1
    assert f["trainer_frozen_base_gb"] < 2 * f["engine_weights_gb"]  # bf16 decoder layers, fp32 embeddings
    rollout = lora["devices"][1]  # the engine's share beside the trainer's resident states (no activations)
    assert rollout["need_gb"] == pytest.approx(0.55 * 80 + f["trainer_model_states_gb"])
    assert not plan.plan(config.load("qwen3-14b"), gpus=1, gpu_mem_gb=80)["fits"]
    full = plan.plan(config.load("qwen3-14b-lora", ["trainer.lora=null"]), gpus=1, gpu_mem_gb=80)
    assert not full["fits"] and full["figures"]["trainer_model_states_gb"] * plan.GIB == 16 * f["params"]


def test_plan_command_prints_the_lora_lines(tmp_path):
    from typer.testing import CliRunner

    from rstar2.cli.main import app

    res = CliRunner().invoke(app, ["plan", "--preset", "qwen3-14b-lora", "--gpus", "1", "--gpu-mem", "80",
                                   "--json", str(tmp_path / "p.json")], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    for line in ("frozen base", "LoRA adapter states", "DeepSpeed ZeRO-2 estimator", "engine LoRA buffers", "fits"):
        assert line in res.output
    assert json.loads((tmp_path / "p.json").read_text())["figures"]["lora_params"] == 128450560
