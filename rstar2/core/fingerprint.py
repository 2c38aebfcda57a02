"""A content fingerprint of a policy's weights, compared after every weight sync (rstar2.run.controller): what each
engine's own model holds, read back from it, against the checkpoint the trainer committed. A sync that silently did
not happen (an engine that kept its old weights, a reload that skipped a layer, a sleeping engine woken on stale
memory) fails the step with one line instead of drifting the run.

What is hashed: every tensor named `*norm.weight` (the RMSNorm/LayerNorm scales), in name order, cast to the engine's
dtype. They are trained every step, and vLLM neither fuses, shards nor repacks them, so an engine's copy reads back on
every backend (vLLM's CPU backend repacks the linear layers for oneDNN and frees their weights, which then cannot be
read back). The rest of the weights is covered functionally by the rollout/train log-prob gap of every step
(rstar2.training.trainer)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable, Iterator

import torch

from rstar2.core import adapter

SUFFIX = "norm.weight"


class WeightSyncError(RuntimeError):
    """An engine serves other weights than the checkpoint it was told to load: the run stops (one line)."""


def of_tensors(named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype) -> str | None:
    """'<tensors>:<sha256 prefix>' of the `*norm.weight` tensors of `named` as `dtype` holds them; None: none."""
    h, n = hashlib.sha256(), 0
    for name, t in sorted(((k, v) for k, v in named if k.endswith(SUFFIX)), key=lambda kv: kv[0]):
        h.update(name.encode())
        # rounded to the engine's dtype as its loader rounds, then hashed as float32 (numpy has no bfloat16)
        h.update(t.detach().to("cpu").to(dtype).float().contiguous().numpy().tobytes())
        n += 1
    return f"{n}:{h.hexdigest()[:16]}" if n else None


def of_model(model: torch.nn.Module) -> tuple[str, str | None]:
    """(dtype name, fingerprint) of a loaded model's parameters, in its own dtype."""
    dtype = next(model.parameters()).dtype
    return str(dtype).removeprefix("torch."), of_tensors(model.named_parameters(), dtype)


def of_checkpoint(model_dir: str | Path, dtype: str) -> str | None:
    """The fingerprint of a model directory as an engine of `dtype` serving it holds it: a LoRA adapter directory's
    adapter (rstar2.core.adapter.fingerprint: the engine serves its base with the adapter enabled), else the norms
    of its safetensors; None: no safetensors (or no tensor to hash), so nothing to compare."""
    from safetensors import safe_open

    if adapter.is_adapter(model_dir):
        return adapter.fingerprint_of_dir(model_dir, dtype)

    def named() -> Iterator[tuple[str, torch.Tensor]]:
        for f in sorted(Path(model_dir).glob("*.safetensors")):
            with safe_open(str(f), "pt") as st:
                for k in st.keys():
                    if k.endswith(SUFFIX):
                        yield k, st.get_tensor(k)

    return of_tensors(named(), getattr(torch, dtype))
