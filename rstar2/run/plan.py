"""Whether a run fits its hardware: per-device memory of the trainer ranks and the engines, and a verdict per device
kind (`rstar2 plan`; the campaign refuses a plan that does not fit before any actor starts).

Trainer model states (weights, gradients, optimizer) come from DeepSpeed's own estimators (ZeRO-2/3, no offload),
or 16 bytes a parameter for the one-process torch backend (fp32 weights, gradients and AdamW's two moments).
Activations and the engines' KV cache are counted from the architecture (formulas below). The parameter count is
the real model's, built on the meta device from its config (no weights read).

With trainer.lora (torch backend) the trainer holds a frozen base (the adapted linear layers' weights in the compute
dtype, every other parameter in fp32, no gradients, no optimizer state) and trains adapters at 16 bytes a parameter; the
reference policy is the base with the adapter disabled (no second model); each engine adds vLLM's LoRA buffers.
tests/unit/test_plan.py measures these figures on a peft-wrapped model after one AdamW step.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from rstar2.core.config import LoraCfg, RunCfg

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "half": 2, "float": 4, "auto": 2}
PROMPT_TOKENS = 1024  # a prompt's share of a sequence, beside its response budget (the system prompt and problem)
ENGINE_RESERVE = 1 * GIB  # vLLM's own runtime beside weights and KV (CUDA graphs off, allocator slack)
TORCH_STATE_BYTES = 16  # torch backend: fp32 weights + gradients + AdamW exp_avg and exp_avg_sq, per parameter
FROZEN_FP32_BYTES = 4  # a LoRA run's base weights outside the adapted layers (embeddings, norms, LM head): fp32
# vLLM's tensor-parallel linears whose input (not output) is split over the ranks (RowParallelLinear) in Llama- and
# Qwen-family models; every other linear layer is column-parallel (qkv_proj, gate_up_proj: the output split)
ROW_PARALLEL = ("o_proj", "down_proj")
ENGINE_BATCHED_TOKENS = 16384  # vLLM's max_num_batched_tokens for the offline LLM class on a >= 70 GB GPU
# vLLM's punica wrapper (LoRA kernels' metadata), per batched token: 4 int64 index tensors (PunicaWrapperBase) and
# 2 LoRAKernelMeta of 2 int32 token maps each (PunicaWrapperGPU)
PUNICA_BYTES_PER_TOKEN = 4 * 8 + 2 * 2 * 4


class PlanError(ValueError):
    """A run that does not fit its hardware, or whose model shape is unknown."""


@dataclass(frozen=True)
class Linear:
    """One nn.Linear of the model: its name as peft sees it (model.layers.0.self_attn.q_proj), its fan-in and
    fan-out (its weight is fan_out x fan_in)."""
    name: str
    fan_in: int
    fan_out: int


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
    linears: tuple[Linear, ...] = ()  # every nn.Linear of the model, in module order
    output_head: str = ""  # the LM head's module name (peft's "all-linear" leaves it out)


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
    linears = tuple(Linear(name, m.in_features, m.out_features)
                    for name, m in model.named_modules() if isinstance(m, nn.Linear))
    head = model.get_output_embeddings()
    head_name = next((name for name, m in model.named_modules() if m is head), "")
    return Shape(params, largest, mc.num_hidden_layers, mc.hidden_size, mc.num_attention_heads * head_dim,
                 getattr(mc, "num_key_value_heads", None) or mc.num_attention_heads, head_dim, mc.intermediate_size,
                 mc.vocab_size, linears, head_name)


def compute_bytes(cfg: RunCfg) -> int:
    """Bytes of one value in the trainer's compute dtype; "auto" (settled when the run starts) is planned at fp32,
    the wider of the two it may become."""
    return 4 if cfg.trainer.dtype == "auto" else DTYPE_BYTES[cfg.trainer.dtype]


def _peft_matches(name: str, target: str) -> bool:
    """peft's rule for a list of target_modules (check_target_module_exists): the module's full name is the target,
    or ends in "." + target (so "q_proj" matches model.layers.0.self_attn.q_proj)."""
    return name == target or name.endswith(f".{target}")


def lora_targets(s: Shape, lora: LoraCfg) -> tuple[Linear, ...]:
    """The linear layers peft adapts. "all-linear": every nn.Linear but the LM head (peft's
    _maybe_include_all_linear_layers), i.e. the decoder layers' projections; a list: each linear layer matched by a
    name in it (_peft_matches). A listed name that matches no linear layer is a PlanError (a typo would otherwise
    train, and plan, fewer layers than meant)."""
    if lora.targets == "all-linear":
        return tuple(lin for lin in s.linears if lin.name != s.output_head)
    missing = [t for t in lora.targets if not any(_peft_matches(lin.name, t) for lin in s.linears)]
    if missing:
        names = sorted({lin.name.rsplit(".", 1)[-1] for lin in s.linears})
        raise PlanError(f"trainer.lora.targets {missing} name no linear layer of the model (its linear layers: "
                        f"{', '.join(names)}; or \"all-linear\")")
    return tuple(lin for lin in s.linears if any(_peft_matches(lin.name, t) for t in lora.targets))


def lora_params(targets: tuple[Linear, ...], rank: int) -> int:
    """Adapter parameters: A (rank x fan_in) and B (fan_out x rank) per adapted layer = rank x sum(fan_in + fan_out)
    (what peft's get_nb_trainable_parameters() counts)."""
    return rank * sum(lin.fan_in + lin.fan_out for lin in targets)


def frozen_base_bytes(s: Shape, targets: tuple[Linear, ...], cfg: RunCfg) -> int:
    """A LoRA run's frozen base on the trainer (rstar2.core.adapter.hold_frozen): the adapted layers' weights in the
    compute dtype, every other parameter (their biases, embeddings, norms, LM head) in fp32; no gradients, no
    optimizer state: compute_bytes x adapted weights + 4 x (params - adapted weights)."""
    adapted = sum(lin.fan_in * lin.fan_out for lin in targets)
    return compute_bytes(cfg) * adapted + FROZEN_FP32_BYTES * (s.params - adapted)


def adapter_states_deepspeed_bytes(adapter_params: int) -> int:
    """DeepSpeed's ZeRO-2 estimator for the adapters alone on one GPU: 20 bytes a parameter (16-bit weights and
    gradients beside fp32 gradients, master weights and Adam's two moments). The torch backend keeps no 16-bit
    copies (bf16 autocast casts on the fly): 16 bytes, 4 fewer."""
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    _, gpu = estimate_zero2_model_states_mem_needs(adapter_params, num_gpus_per_node=1, cpu_offload=False)
    return gpu


def model_states_bytes(s: Shape, cfg: RunCfg) -> int:
    """Weights, gradients and optimizer state on one trainer rank (DeepSpeed's estimator, no CPU offload). LoRA: the
    frozen base plus 16 bytes per adapter parameter (fp32 weight, gradient, exp_avg, exp_avg_sq)."""
    t = cfg.trainer
    if t.lora is not None:
        targets = lora_targets(s, t.lora)
        return frozen_base_bytes(s, targets, cfg) + TORCH_STATE_BYTES * lora_params(targets, t.lora.rank)
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
    its logits in the compute dtype, their fp32 copy for the log-softmax and its gradient (vocab x (b + 8)). LoRA
    adds to a layer the rank-sized intermediate A x that B keeps, per adapted linear of that layer (rank x b each)."""
    b = compute_bytes(cfg)
    tokens = cfg.trainer.micro_batch_tokens
    per_layer = b * (4 * s.hidden + 3 * s.q_dim + 4 * s.kv_heads * s.head_dim + 4 * s.ffn)
    if cfg.trainer.lora is not None:
        adapted_per_layer = -(-len(lora_targets(s, cfg.trainer.lora)) // s.layers)
        per_layer += b * cfg.trainer.lora.rank * adapted_per_layer
    layers = (s.layers * b * s.hidden + per_layer) if checkpointing else s.layers * per_layer
    return tokens * (layers + s.vocab * (b + 8))


def reference_bytes(s: Shape, cfg: RunCfg) -> int:
    """The frozen reference policy (kl_coef > 0): its weights in the compute dtype, partitioned under ZeRO-3. None
    under LoRA: the reference is the trainer's own base with the adapter disabled."""
    t = cfg.trainer
    if t.kl_coef <= 0 or t.lora is not None:
        return 0
    shards = t.world_size if t.backend == "deepspeed" and t.zero_stage == 3 else 1
    return DTYPE_BYTES[t.dtype] * s.params // shards


def kv_bytes_per_token(s: Shape, cfg: RunCfg) -> int:
    """K and V of every layer on one GPU of an engine: vLLM splits KV heads over the tensor-parallel ranks
    (replicating them when there are fewer heads than ranks)."""
    heads = max(1, s.kv_heads // cfg.engine.tensor_parallel_size)
    return 2 * s.layers * heads * s.head_dim * DTYPE_BYTES[cfg.engine.dtype]


def engine_lora_rank(cfg: RunCfg) -> int:
    """The max_lora_rank the engines start with: the adapter's rank rounded up to one vLLM offers (0: no LoRA)."""
    from rstar2.rollout.vllm_backend import vllm_lora_rank

    return vllm_lora_rank(cfg.trainer.lora.rank) if cfg.trainer.lora is not None else 0


def engine_lora_bytes(s: Shape, cfg: RunCfg) -> int:
    """vLLM's LoRA buffers on one GPU of an engine (enable_lora, max_loras = 1 slot, max_lora_rank = r =
    engine_lora_rank; in the engine's dtype; vllm/lora/layers, allocated when the model loads, before the KV cache is
    sized):
      - every linear layer but the head (the engine is given no target_modules, so vLLM wraps all it supports,
        whatever the trainer's targets): lora_a_stacked r x in and lora_b_stacked out x r per output slice (qkv_proj
        holds q, k and v as 3 slices, gate_up_proj 2: the same sizes as peft's separate layers); column-parallel
        layers split out over the TP ranks, row-parallel ones (ROW_PARALLEL) split in:
        r x (in + out / tp) or r x (in / tp + out);
      - the input embedding (VocabParallelEmbeddingWithLoRA: vocab x r and hidden x r) and the LM head
        (LogitsProcessorWithLoRA: r x hidden and vocab x r), unsplit: 2 r (vocab + hidden). Counted for every model
        (Qwen3 and Llama declare them in embedding_modules; a model that does not, e.g. Qwen2, holds less);
      - the punica wrapper's index tensors: PUNICA_BYTES_PER_TOKEN x ENGINE_BATCHED_TOKENS (~0.8 MB).
    The LoRA kernels' fp32 scratch (slices x tokens x r per layer call) is transient, within ENGINE_RESERVE."""
    r, tp = engine_lora_rank(cfg), cfg.engine.tensor_parallel_size
    if not r:
        return 0
    linears = sum(r * (lin.fan_in // tp + lin.fan_out) if lin.name.rsplit(".", 1)[-1] in ROW_PARALLEL
                  else r * (lin.fan_in + lin.fan_out // tp) for lin in s.linears if lin.name != s.output_head)
    embeddings = 2 * r * (s.vocab + s.hidden)
    return (linears + embeddings) * DTYPE_BYTES[cfg.engine.dtype] + PUNICA_BYTES_PER_TOKEN * ENGINE_BATCHED_TOKENS


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
    engine_lora = engine_lora_bytes(s, cfg)
    kv_token, seq = kv_bytes_per_token(s, cfg), sequence_tokens(cfg)
    figures = {"params": s.params, "largest_layer_params": s.largest_layer, "trainer_model_states_gb": states / GIB,
               "trainer_reference_gb": ref / GIB, "trainer_activations_gb": act / GIB,
               "trainer_activations_other_gb": activation_bytes(s, cfg, not t.gradient_checkpointing) / GIB,
               "trainer_gb": trainer / GIB, "engine_weights_gb": weights / GIB,
               "kv_bytes_per_token": kv_token, "sequence_tokens": seq, "rollouts_per_engine": rollouts_per_engine(cfg)}
    if t.lora is not None:
        figures.update(lora_figures(s, cfg), engine_lora_rank=engine_lora_rank(cfg), engine_lora_gb=engine_lora / GIB)
    static = weights + engine_lora  # what an engine holds before its KV cache
    devices = _cpu(cfg, figures, trainer, static) if gpus == 0 else _gpu(cfg, figures, gpus, mem, trainer, static)
    return {"gpus": gpus, "gpu_mem_gb": mem, "figures": figures, "devices": [asdict(d) for d in devices],
            "fits": all(d.fits for d in devices)}


def lora_figures(s: Shape, cfg: RunCfg) -> dict:
    """A LoRA run's trainer figures: what it adapts, its frozen base and adapter states, and DeepSpeed's estimator
    for the same adapters beside them (trainer_model_states_gb = frozen base + adapter states)."""
    lora = cfg.trainer.lora
    targets = lora_targets(s, lora)
    n = lora_params(targets, lora.rank)
    return {"lora_rank": lora.rank, "lora_adapted_layers": len(targets), "lora_params": n,
            "trainer_frozen_base_gb": frozen_base_bytes(s, targets, cfg) / GIB,
            "trainer_adapter_states_gb": TORCH_STATE_BYTES * n / GIB,
            "trainer_adapter_states_deepspeed_gb": adapter_states_deepspeed_bytes(n) / GIB}


def _cpu(cfg: RunCfg, f: dict, trainer: int, engine_static: int) -> list[Device]:
    """One machine's RAM holds the trainer and every engine (weights, LoRA buffers and its kv_cache_mb)."""
    e = cfg.engine
    engines = e.num_engines * (engine_static + e.kv_cache_mb * 2**20)
    need, have = (trainer + engines) / GIB, host_mem_gb()
    f["kv_capacity_tokens"] = e.kv_cache_mb * 2**20 // f["kv_bytes_per_token"]
    ok = f["kv_capacity_tokens"] >= f["sequence_tokens"]
    return [Device("cpu", 1, need, have, need <= have and ok,
                   f"trainer + {e.num_engines} engine(s) with {e.kv_cache_mb} MB KV each"
                   + ("" if ok else f"; KV holds {f['kv_capacity_tokens']} tokens < one sequence"))]


def _gpu(cfg: RunCfg, f: dict, gpus: int, mem: float, trainer: int, engine_static: int) -> list[Device]:
    """Per GPU: an engine's weights and LoRA buffers (engine_static), its runtime and KV cache within
    gpu_memory_utilization; the trainer's ranks on GPUs of their own or, colocated, on the engines' GPUs."""
    e, t, p = cfg.engine, cfg.trainer, cfg.placement
    engine_gpus = e.num_engines * e.tensor_parallel_size
    util = e.gpu_memory_utilization or 0.9
    budget = util * mem * GIB  # vLLM sizes its KV cache to fill this share of the GPU
    kv_free = budget - engine_static - ENGINE_RESERVE
    f["kv_capacity_tokens"] = max(0, int(kv_free // f["kv_bytes_per_token"]))
    f["concurrent_sequences"] = f["kv_capacity_tokens"] // f["sequence_tokens"]
    kv_ok = f["concurrent_sequences"] >= 1
    kv_note = (f"KV {f['kv_capacity_tokens']:,} tokens = {f['concurrent_sequences']} x {f['sequence_tokens']}-token "
               f"sequences (asked {f['rollouts_per_engine']} at once)")
    eng_need = (engine_static + ENGINE_RESERVE) / GIB
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
