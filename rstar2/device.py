"""Hardware-agnostic device choice: CUDA and ROCm both appear as torch "cuda"; CPU otherwise."""

from __future__ import annotations

import contextlib

import torch


def pick(requested: str = "auto") -> torch.device:
    if requested != "auto":
        return torch.device(requested)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def autocast(device: torch.device, dtype: str):
    """bf16 autocast where the device supports it (CPU with AVX-512 bf16, CUDA, ROCm); no-op for fp32."""
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=getattr(torch, dtype))
