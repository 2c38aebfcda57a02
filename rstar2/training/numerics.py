"""The trainer's numerics (trainer.dtype): fp32, or bf16 autocast (fp32 master weights and optimizer state, bf16
matrix products; attention in fp32 on a CPU: rstar2.training.batching.varlen_attention). `auto` takes bf16 where
the device multiplies bf16 in hardware (a GPU that reports bf16; a CPU with AMX tiles or AVX-512 BF16) and fp32
elsewhere: a CPU without them emulates bf16 products more slowly than it multiplies fp32. What bf16 gains on a CPU
that has it depends on the model's width (bench/README.md, "Trainer roofline": ~1.15x at a 3M model's, more at a
135M model's), so a preset may still set its dtype by what was measured for it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class Choice:
    dtype: str   # "float32" or "bfloat16"
    reason: str  # why, in words (printed at the start of a run)


def fast_bf16(device: torch.device) -> bool:
    """Whether `device` multiplies bf16 in hardware: a CUDA/ROCm GPU that supports it, a CPU with AMX tiles or the
    AVX-512 BF16 instructions (torch's own cpuinfo checks)."""
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    return False


def choose(requested: str, device: torch.device) -> Choice:
    """The dtype a trainer on `device` computes in: `requested` itself unless it is "auto"."""
    if requested in DTYPES:
        return Choice(requested, "set in the config")
    if requested != "auto":
        raise ValueError(f"trainer.dtype must be auto, float32 or bfloat16, got {requested!r}")
    if fast_bf16(device):
        return Choice("bfloat16", f"this {device.type} multiplies bf16 in hardware")
    return Choice("float32", f"this {device.type} has no fast bf16")
