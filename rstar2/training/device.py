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


def reset_peak_memory(device: torch.device) -> None:
    """Start a fresh peak-memory window: CUDA allocator peak, or the process's peak RSS on CPU (Linux VmHWM)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory since `reset_peak_memory`: CUDA max allocated, or peak RSS of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
