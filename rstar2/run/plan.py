"""Whether a run fits its hardware: per-device memory of the trainer ranks and the engines, and a verdict per device
kind (`rstar2 plan`; the campaign refuses a plan that does not fit before any actor starts).

Trainer model states (weights, gradients, optimizer) come from DeepSpeed's own estimators (ZeRO-2/3, no offload),
or 16 bytes a parameter for the one-process torch backend (fp32 weights, gradients and AdamW's two moments).
Activations and the engines' KV cache are counted from the architecture (formulas below). The parameter count is
the real model's, built on the meta device from its config (no weights read).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from rstar2.core.config import RunCfg

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "half": 2, "float": 4, "auto": 2}
PROMPT_TOKENS = 1024  # a prompt's share of a sequence, beside its response budget (the system prompt and problem)
ENGINE_RESERVE = 1 * GIB  # vLLM's own runtime beside weights and KV (CUDA graphs off, allocator slack)
TORCH_STATE_BYTES = 16  # torch backend: fp32 weights + gradients + AdamW exp_avg and exp_avg_sq, per parameter


class PlanError(ValueError):
    """A run that does not fit its hardware, or whose model shape is unknown."""


@dataclass(frozen=True)
class Shape:
    """What memory depends on: parameters, the largest layer's (ZeRO-3 gathers one at a time) and the sizes."""
    params: int
    largest_layer: int
    layers: int
    hidden: int
    q_dim: int  # heads x head_dim
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int


@dataclass
class Device:
    kind: str  # trainer / engine / colocated / cpu
    count: int
    need_gb: float
    have_gb: float
    fits: bool
    detail: str


def model_config(cfg: RunCfg) -> PretrainedConfig:
    """The base model's config.json where it is on this machine, else world.arch, else the imported model's own
    config (read from its file: ~25 s for a GGUF, which world.arch saves), else the tiny world's model."""
    w = cfg.world
    if w.base_model and (Path(w.base_model) / "config.json").is_file():
        return AutoConfig.from_pretrained(w.base_model)
    if w.arch:
        arch = dict(w.arch)
        model_type = arch.pop("model_type", None)
        if not model_type:
            raise PlanError("world.arch must name its model_type (as in the model's config.json)")
        return AutoConfig.for_model(model_type, **arch)
    if w.import_model:
        from rstar2.models import importer

        return importer.config_of(w.import_model)
    if w.base_model:
        raise PlanError(f"world.base_model {w.base_model} has no config.json on this machine: set world.arch to its "
                        "config.json fields to plan without the weights")
    from rstar2.world.model import config

    return config(w.vocab_size, w.hidden, w.layers, w.heads, w.kv_heads, w.ffn, w.max_positions)


def shape(mc: PretrainedConfig) -> Shape:
    """Counted on the meta device (no memory); the largest layer is DeepSpeed's definition (a module's own params)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(mc)
    params = sum(p.numel() for p in model.parameters())  # tied embeddings counted once
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
    return Shape(params, largest, mc.num_hidden_layers, mc.hidden_size, mc.num_attention_heads * head_dim,
                 getattr(mc, "num_key_value_heads", None) or mc.num_attention_heads, head_dim, mc.intermediate_size,
                 mc.vocab_size)


def model_states_bytes(s: Shape, cfg: RunCfg) -> int:
    """Weights, gradients and optimizer state on one trainer rank (DeepSpeed's estimator, no CPU offload)."""
    t = cfg.trainer
    if t.backend == "torch":
        return TORCH_STATE_BYTES * s.params
    if t.zero_stage == 3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        _, gpu, _ = estimate_zero3_model_states_mem_needs(s.params, s.largest_layer, num_gpus_per_node=t.world_size,
                                                          cpu_offload=False, cpu_offload_params=False, zero_init=True)
        return gpu
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    _, gpu = estimate_zero2_model_states_mem_needs(s.params, num_gpus_per_node=t.world_size, cpu_offload=False)
    return gpu


def activation_bytes(s: Shape, cfg: RunCfg, checkpointing: bool) -> int:
    """One micro-batch's activations kept for backward. Per token and decoder layer autograd keeps (flash/SDPA
    attention, so no sequence-squared term) the two norms' inputs and outputs (4h), q, k, v before and after RoPE and
    the attention output (3 q_dim + 4 kv_dim), and the SwiGLU MLP's gate, up, act(gate) and product (4 ffn), in the
    compute dtype. With checkpointing a layer keeps its input (h) and one layer at a time is rebuilt. The LM head adds
    its logits in the compute dtype, their fp32 copy for the log-softmax and its gradient (vocab x (b + 8))."""
    b = 4 if cfg.trainer.dtype == "auto" else DTYPE_BYTES[cfg.trainer.dtype]  # auto: planned at the wider dtype
    tokens = cfg.trainer.micro_batch_tokens
    per_layer = b * (4 * s.hidden + 3 * s.q_dim + 4 * s.kv_heads * s.head_dim + 4 * s.ffn)
    layers = (s.layers * b * s.hidden + per_layer) if checkpointing else s.layers * per_layer
    return tokens * (layers + s.vocab * (b + 8))


def reference_bytes(s: Shape, cfg: RunCfg) -> int:
    """The frozen reference policy (kl_coef > 0): its weights in the compute dtype, partitioned under ZeRO-3."""
    t = cfg.trainer
    if t.kl_coef <= 0:
        return 0
    shards = t.world_size if t.backend == "deepspeed" and t.zero_stage == 3 else 1
    return DTYPE_BYTES[t.dtype] * s.params // shards


def kv_bytes_per_token(s: Shape, cfg: RunCfg) -> int:
    """K and V of every layer on one GPU of an engine: vLLM splits KV heads over the tensor-parallel ranks
    (replicating them when there are fewer heads than ranks)."""
    heads = max(1, s.kv_heads // cfg.engine.tensor_parallel_size)
    return 2 * s.layers * heads * s.head_dim * DTYPE_BYTES[cfg.engine.dtype]


def sequence_tokens(cfg: RunCfg) -> int:
    """The longest rollout: a prompt and the largest response budget of any stage, within the context length."""
    budgets = [st.max_response_tokens or cfg.rollout.max_response_tokens for st in cfg.stages]
    return min(cfg.world.max_positions, PROMPT_TOKENS + max(budgets or [cfg.rollout.max_response_tokens]))


def rollouts_per_engine(cfg: RunCfg) -> int:
    """Sequences an engine is asked to hold at once in the largest step (at most scheduler.max_inflight)."""
    per_prompt = cfg.rollout.group_size * (cfg.rollout.oversample if cfg.roc.enabled else 1)
    prompts = max([st.prompts_per_step for st in cfg.stages] or [1])
    return min(cfg.scheduler.max_inflight, -(-prompts * per_prompt // cfg.engine.num_engines))


def host_mem_gb() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB


def plan(cfg: RunCfg, gpus: int | None = None, gpu_mem_gb: float | None = None) -> dict:
    """The figures and the verdict for `cfg` on `gpus` accelerators of `gpu_mem_gb` each (default: cfg.placement's;
    0 GPUs: this machine's RAM holds everything)."""
    gpus = cfg.placement.gpus if gpus is None else gpus
    mem = cfg.placement.gpu_mem_gb if gpu_mem_gb is None else gpu_mem_gb
    s = shape(model_config(cfg))
    t, e = cfg.trainer, cfg.engine
    states, ref = model_states_bytes(s, cfg), reference_bytes(s, cfg)
    act = activation_bytes(s, cfg, t.gradient_checkpointing)
    trainer = states + ref + act
    weights = s.params * DTYPE_BYTES[e.dtype] // e.tensor_parallel_size
    kv_token, seq = kv_bytes_per_token(s, cfg), sequence_tokens(cfg)
    figures = {"params": s.params, "largest_layer_params": s.largest_layer, "trainer_model_states_gb": states / GIB,
               "trainer_reference_gb": ref / GIB, "trainer_activations_gb": act / GIB,
               "trainer_activations_other_gb": activation_bytes(s, cfg, not t.gradient_checkpointing) / GIB,
               "trainer_gb": trainer / GIB, "engine_weights_gb": weights / GIB,
               "kv_bytes_per_token": kv_token, "sequence_tokens": seq, "rollouts_per_engine": rollouts_per_engine(cfg)}
    devices = _cpu(cfg, figures, trainer, weights) if gpus == 0 else _gpu(cfg, figures, gpus, mem, trainer, weights)
    return {"gpus": gpus, "gpu_mem_gb": mem, "figures": figures, "devices": [asdict(d) for d in devices],
            "fits": all(d.fits for d in devices)}


def _cpu(cfg: RunCfg, f: dict, trainer: int, weights: int) -> list[Device]:
    e = cfg.engine
    engines = e.num_engines * (weights + e.kv_cache_mb * 2**20)
    need, have = (trainer + engines) / GIB, host_mem_gb()
    f["kv_capacity_tokens"] = e.kv_cache_mb * 2**20 // f["kv_bytes_per_token"]
    ok = f["kv_capacity_tokens"] >= f["sequence_tokens"]
    return [Device("cpu", 1, need, have, need <= have and ok,
                   f"trainer + {e.num_engines} engine(s) with {e.kv_cache_mb} MB KV each"
                   + ("" if ok else f"; KV holds {f['kv_capacity_tokens']} tokens < one sequence"))]


def _gpu(cfg: RunCfg, f: dict, gpus: int, mem: float, trainer: int, weights: int) -> list[Device]:
    e, t, p = cfg.engine, cfg.trainer, cfg.placement
    engine_gpus = e.num_engines * e.tensor_parallel_size
    util = e.gpu_memory_utilization or 0.9
    budget = util * mem * GIB  # vLLM sizes its KV cache to fill this share of the GPU
    kv_free = budget - weights - ENGINE_RESERVE
    f["kv_capacity_tokens"] = max(0, int(kv_free // f["kv_bytes_per_token"]))
    f["concurrent_sequences"] = f["kv_capacity_tokens"] // f["sequence_tokens"]
    kv_ok = f["concurrent_sequences"] >= 1
    kv_note = (f"KV {f['kv_capacity_tokens']:,} tokens = {f['concurrent_sequences']} x {f['sequence_tokens']}-token "
               f"sequences (asked {f['rollouts_per_engine']} at once)")
    eng_need = (weights + ENGINE_RESERVE) / GIB
    if p.colocate:
        # engines sleep (weights to CPU, KV freed) while the trainer updates; its model states stay resident meanwhile
        n = max(engine_gpus, t.world_size)
        resident = (trainer / GIB - f["trainer_activations_gb"])
        count_ok = n <= gpus and engine_gpus == t.world_size
        count = "" if count_ok else (f"; needs {n} GPUs, has {gpus}" if engine_gpus == t.world_size else
                                     f"; engine GPUs ({engine_gpus}) must equal trainer ranks ({t.world_size})")
        # vLLM takes gpu_memory_utilization x the GPU for itself: that and the trainer's states must fit together
        return [Device("colocated (update)", n, trainer / GIB, mem, trainer / GIB <= mem and count_ok,
                       f"{t.world_size} rank(s), engines asleep{count}"),
                Device("colocated (rollout)", n, util * mem + resident, mem,
                       util * mem + resident <= mem and eng_need <= util * mem and kv_ok and count_ok,
                       f"{e.num_engines} engine(s) x TP{e.tensor_parallel_size} ({util:g} of the GPU) beside the "
                       f"trainer's model states; {kv_note}{count}")]
    room = engine_gpus + t.world_size <= gpus
    count = "" if room else f"; needs {engine_gpus} + {t.world_size} GPUs, has {gpus} (or placement.colocate)"
    return [Device("trainer", t.world_size, trainer / GIB, mem, trainer / GIB <= mem and room,
                   f"ZeRO-{t.zero_stage if t.backend == 'deepspeed' else 0} over {t.world_size} rank(s), "
                   f"checkpointing {'on' if t.gradient_checkpointing else 'off'}{count}"),
            Device("engine", engine_gpus, eng_need, util * mem, eng_need <= util * mem and kv_ok and room,
                   f"{e.num_engines} engine(s) x TP{e.tensor_parallel_size}; {kv_note}{count}")]


def require_fit(cfg: RunCfg) -> dict:
    """The plan for the run's own placement; PlanError naming what does not fit."""
    res = plan(cfg)
    bad = [d for d in res["devices"] if not d["fits"]]
    if bad:
        where = f"{res['gpus']} x {res['gpu_mem_gb']:g} GB GPUs" if res["gpus"] else "this machine's RAM"
        raise PlanError(f"run {cfg.name} does not fit {where} (placement.gpus / placement.gpu_mem_gb): " + "; ".join(
            f"{d['kind']} needs {d['need_gb']:.1f} GB of {d['have_gb']:.1f} GB ({d['detail']})" for d in bad)
            + " - see `rstar2 plan`")
    return res



def settle_numerics(cfg: RunCfg, previous: Path | None = None) -> tuple[RunCfg, str]:
    """The run's config with trainer.dtype "auto" replaced by what this host's trainer will compute in
    (rstar2.training.numerics), and why in words. A run resumed from `previous` (its config.json) keeps the dtype it
    started with, also on another host."""
    from rstar2.training import numerics
    from rstar2.training.device import pick

    if cfg.trainer.dtype != "auto":
        return cfg, f"trainer.dtype {cfg.trainer.dtype}: set in the config"
    if previous is not None and previous.is_file():
        before = _dtype_in(previous)
        if before in numerics.DTYPES:
            return cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"dtype": before})}), \
                f"trainer.dtype {before}: as the run started ({previous})"
    device = pick(cfg.trainer.device)
    if device.type == "cpu" and cfg.placement.gpus and cfg.trainer.device == "auto":
        return cfg, "trainer.dtype auto: each trainer rank settles it on its own GPU (none on this machine)"
    choice = numerics.choose("auto", device)
    return cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"dtype": choice.dtype})}), \
        f"trainer.dtype {choice.dtype}: {choice.reason}"


def _dtype_in(config_json: Path) -> str | None:
    """trainer.dtype in a run's config.json, or None where it cannot be read (a run whose other settings changed is
    refused later, naming them: rstar2.core.tracking)."""
    import json

    try:
        return json.loads(config_json.read_text()).get("trainer", {}).get("dtype")
    except (OSError, ValueError, AttributeError):
        return None
