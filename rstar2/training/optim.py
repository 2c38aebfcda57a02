"""The optimizer and learning-rate schedule every trainer backend uses (torch and DeepSpeed build the same ones)."""

from __future__ import annotations

import math

import torch

from rstar2.core.config import TrainerCfg


def schedule(warmup_steps: int, decay_steps: int, min_lr_frac: float, stable_steps: int = 0):
    """LR multiplier at optimizer step s: linear warm-up over W = `warmup_steps`; then, with D = `decay_steps` > 0, a
    cosine from 1 down to f = `min_lr_frac` over D steps after S = `stable_steps` steps at 1 (and flat after), or
    constant with D = 0 (the paper's RL: 20 steps of warm-up, then constant). S > 0 is warm-up-stable-decay (WSD):

        m(s) = min(1, (s+1)/W) * (f + (1 - f) * (1 + cos(pi * clip((s - S)/D, 0, 1))) / 2)
    """
    def m(s: int) -> float:
        warm = min(1.0, (s + 1) / max(1, warmup_steps))
        if decay_steps <= 0:
            return warm
        f, x = min_lr_frac, min(1.0, max(0.0, (s - stable_steps) / decay_steps))
        return warm * (f + (1 - f) * 0.5 * (1 + math.cos(math.pi * x)))
    return m


def lr_lambda(c: TrainerCfg):
    """The RL trainer's schedule (`schedule` with its config's warm-up, decay and floor)."""
    return schedule(c.warmup_steps, c.decay_steps, c.min_lr_frac)


def adamw(params, lr: float, weight_decay: float, device: torch.device,
          betas: tuple[float, float] = (0.9, 0.999)) -> torch.optim.AdamW:
    """AdamW, fused where torch has the kernel (CPU and CUDA: one pass over all parameters a step, the for-loop
    version's math); the RL trainers (torch and DeepSpeed) and the SFT all step with it."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas,
                             fused=device.type in ("cpu", "cuda"))
