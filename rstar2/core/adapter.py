"""LoRA adapters (Hu et al. 2021) made with `peft`: on each target linear layer W x + (alpha / rank) B A x, with
A (rank, in) and B (out, rank) trained and W frozen.

An adapter directory is peft's (adapter_config.json, adapter_model.safetensors) beside the tokenizer and the trainer's
state of a checkpoint; its adapter_config.json names the base model directory (`base_model_name_or_path`, absolute).
Such a directory stands for the model base + adapter wherever a model directory goes: the trainer resumes it, the
engines serve the base with the adapter enabled (vLLM LoRA), `export` merges it into a plain HF directory.

Numerics: the frozen weights of the adapted layers are held in the trainer's compute dtype (under bf16 autocast a
linear layer multiplies in bf16 whatever it stores, so this saves memory without changing a product); every other base
weight and the adapters stay fp32.

The adapter fingerprint (`fingerprint`) is what the engines' copy is checked against after each sync: every A and B
tensor in the engine's dtype, B scaled by alpha / rank as vLLM folds it in, hashed by module name. vLLM packs q/k/v
and gate/up into one layer each; the engine side unpacks them to these names (rstar2.rollout.vllm_backend).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from rstar2.core.config import LoraCfg

if TYPE_CHECKING:
    import torch

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."  # peft's names: base_model.model.<module>.lora_A.weight


def is_adapter(model_dir: str | Path) -> bool:
    return (Path(model_dir) / CONFIG).is_file()


def config_of(adapter_dir: str | Path) -> dict:
    return json.loads((Path(adapter_dir) / CONFIG).read_text())


def base_of(adapter_dir: str | Path) -> str:
    """The base model directory an adapter was trained on; one clear error where it is not on this machine."""
    base = config_of(adapter_dir).get("base_model_name_or_path")
    if not base or not (Path(base) / "config.json").is_file():
        raise ValueError(f"{adapter_dir}: its adapter's base model {base!r} (adapter_config.json, "
                         "base_model_name_or_path) is not a model directory on this machine")
    return base


def rank_of(adapter_dir: str | Path) -> int:
    return int(config_of(adapter_dir)["r"])


def peft_config(lora: LoraCfg, base_dir: str):
    from peft import LoraConfig

    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, bias="none",
                      target_modules=lora.targets, task_type="CAUSAL_LM", base_model_name_or_path=str(base_dir))


def attach(model: "torch.nn.Module", lora: LoraCfg, base_dir: str, frozen_dtype: "torch.dtype | None" = None):
    """`model` with a fresh adapter (A random from torch's generator, B zero: the base model's outputs exactly) and
    every base weight frozen; the peft wrapper (it saves the adapter). `model` itself is changed in place: its
    forward goes through the adapters."""
    from peft import get_peft_model

    wrapped = get_peft_model(model, peft_config(lora, base_dir))
    hold_frozen(wrapped, frozen_dtype)
    return wrapped


def resume(model: "torch.nn.Module", adapter_dir: str | Path, frozen_dtype: "torch.dtype | None" = None):
    """`model` (the adapter's base, loaded) with the adapter of `adapter_dir`, trainable; the peft wrapper."""
    from peft import PeftModel

    wrapped = PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=True)
    hold_frozen(wrapped, frozen_dtype)
    return wrapped


def hold_frozen(wrapped, dtype: "torch.dtype | None") -> None:
    """The adapted layers' frozen weights in `dtype` (the compute dtype; None: fp32, as loaded); adapters and other
    weights untouched."""
    import torch

    if dtype in (None, torch.float32):
        return
    from peft.tuners.lora import LoraLayer

    for module in wrapped.modules():
        if isinstance(module, LoraLayer):
            base = module.get_base_layer()
            base.weight.data = base.weight.data.to(dtype)


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def state_dict(wrapped) -> dict[str, torch.Tensor]:
    """The adapter's tensors under peft's file names, on CPU (what adapter_model.safetensors holds)."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().to("cpu", copy=True) for k, v in get_peft_model_state_dict(wrapped).items()}


def load_weights(wrapped, adapter_dir: str | Path) -> None:
    """The adapter tensors of `adapter_dir` into the live adapter (the optimizer keeps its parameter objects)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    res = set_peft_model_state_dict(wrapped, load_file(str(Path(adapter_dir) / WEIGHTS)))
    if res.unexpected_keys:
        raise ValueError(f"{adapter_dir}: adapter tensors that this adapter does not have: {res.unexpected_keys}")


def payload(wrapped) -> dict:
    """The adapter as one value for the engines (the memory sync): its peft config and tensors."""
    cfg = wrapped.peft_config["default"].to_dict()
    return {"config": json.loads(json.dumps(cfg, default=list)), "tensors": state_dict(wrapped)}


def is_payload(value) -> bool:
    return isinstance(value, dict) and value.keys() == {"config", "tensors"}


def write(payload_: dict, out: str | Path) -> Path:
    """An adapter sent as `payload` written as peft's directory (an engine loads adapters from a directory)."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in payload_["tensors"].items()}, str(out / WEIGHTS))
    (out / CONFIG).write_text(json.dumps(payload_["config"]))
    return out


def nbytes(adapter_dir: str | Path) -> int:
    return (Path(adapter_dir) / WEIGHTS).stat().st_size


def scaling(config: dict) -> float:
    r, alpha = config["r"], config["lora_alpha"]
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def fingerprint(modules: Iterable[tuple[str, torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> str | None:
    """'lora <modules>:<names sha>:<values sha>' of (module name, A, B already scaled) triples, each rounded to
    `dtype`; None: none. Two fingerprints with other names are not comparable (another model family's naming); with
    the same names, other values mean other adapter weights."""
    names, values, n = hashlib.sha256(), hashlib.sha256(), 0
    for name, a, b in sorted(modules, key=lambda m: m[0]):
        names.update(name.encode())
        for t in (a, b):
            values.update(t.detach().to("cpu").to(dtype).float().contiguous().numpy().tobytes())
        n += 1
    return f"lora {n}:{names.hexdigest()[:8]}:{values.hexdigest()[:16]}" if n else None


def comparable(a: str | None, b: str | None) -> bool:
    """Whether two adapter fingerprints name the same modules (so their values can be compared)."""
    return bool(a and b) and a.rsplit(":", 1)[0] == b.rsplit(":", 1)[0]


def fingerprint_of_tensors(tensors: dict, config: dict, dtype: "torch.dtype") -> str | None:
    """The fingerprint of peft-named adapter tensors as an engine of `dtype` holds them: B rounded to `dtype`, then
    multiplied by alpha / rank in `dtype` (vLLM's `optimize`, in place on its copy)."""
    s, pairs = scaling(config), {}
    for key, t in tensors.items():
        module, _, part = key.removeprefix(PREFIX).rpartition(".lora_")
        pairs.setdefault(module, {})[part.split(".")[0]] = t
    return fingerprint(((m, ab["A"], ab["B"].to(dtype) * s) for m, ab in pairs.items() if {"A", "B"} <= set(ab)),
                       dtype)


def fingerprint_of_dir(adapter_dir: str | Path, dtype: str) -> str | None:
    import torch
    from safetensors.torch import load_file

    return fingerprint_of_tensors(load_file(str(Path(adapter_dir) / WEIGHTS)), config_of(adapter_dir),
                                  getattr(torch, dtype))


def merge(adapter_dir: str | Path, out: str | Path) -> None:
    """The base model with the adapter merged into its weights (W + (alpha / rank) B A, in fp32), saved to `out` as a
    plain HF model directory (weights and config; the caller copies the tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_of(adapter_dir), dtype=torch.float32)
    from peft import PeftModel

    merged = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(str(out), safe_serialization=True)
