"""GRPO-RoC objective (rStar2-Agent, arXiv 2508.20722, §2.2.3, Eq. 6-7).

    Â_i,t = (r_i - mean({r_j})) / std({r_j})                     over the G rollouts RoC kept   (Eq. 7)
    J     = 1/Σ_i|o_i| Σ_i Σ_t min(ρ_i,t Â_i,t, clip(ρ_i,t, 1-ε_low, 1+ε_high) Â_i,t)          (Eq. 6)
    ρ_i,t = π_θ(o_i,t | ...) / π_θold(o_i,t | ...),   ε_low = 0.2, ε_high = 0.28,  no KL, no entropy term

We minimise -J. Following the released code (built on verl): std is unbiased (torch.std)
with +1e-6; log-ratios are clamped to ±20 before exp; dual-clip (c = 3, caps the loss of A < 0 tokens) is
available but off unless asked for; tokens are only the model's own (mask 0 on prompt, tool output, padding).
The 1/Σ|o_i| normaliser is over the whole batch: pass `num_tokens` = the global count so that summing
micro-batch losses under gradient accumulation reproduces Eq. 6 exactly (verl's per-micro-batch mean
rescaled by a nominal batch size does not).

Shapes: the trainer passes flat token vectors (N,) (only the loss tokens are ever computed); tests also use padded (B,
T) grids. `advantages` is per sequence (B,) for a grid, or already per token (same shape as logp). Off-recipe options:
`is_weight` = a constant per-token weight: a truncated importance weight min(π_old/π_engine, C) (Yao et al. 2025, "TIS")
for rollouts sampled by an engine whose numerics differ from the trainer's; KL and entropy below."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def group_advantages(rewards: Tensor, group_ids: Tensor, eps: float = 1e-6) -> Tensor:
    """Eq. 7 per group: (r - mean_g) / (std_g + eps), unbiased std; a group of one gets 0 (verl gives it r)."""
    r = rewards if rewards.is_floating_point() else rewards.float()            # (N,)
    uniq, inv = torch.unique(group_ids, return_inverse=True)                  # inv: (N,) group index 0..G-1
    count = torch.zeros(uniq.numel(), dtype=r.dtype, device=r.device).index_add_(0, inv, torch.ones_like(r))  # (G,)
    mean = torch.zeros_like(count).index_add_(0, inv, r) / count                                          # (G,)
    centred = r - mean[inv]                                                                                # (N,)
    # Unbiased variance; a singleton has centred == 0, so clamping n-1 to 1 makes its advantage exactly 0.
    var = torch.zeros_like(count).index_add_(0, inv, centred * centred) / (count - 1).clamp(min=1)       # (G,)
    return centred / (var.sqrt()[inv] + eps)                                                               # (N,)


def masked_token_mean(x: Tensor, mask: Tensor, num_tokens: float | Tensor | None = None) -> Tensor:
    """Σ x over mask / num_tokens (default: mask.sum(), at least 1 so an empty mask gives 0, not NaN)."""
    m = mask.bool()                                                             # (B, T)
    total = torch.where(m, x, torch.zeros_like(x)).sum()
    denom = m.sum() if num_tokens is None else torch.as_tensor(num_tokens, device=x.device)
    return total / denom.clamp(min=1).to(x.dtype)


def policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, eps_low: float = 0.2,
                eps_high: float = 0.28, dual_clip: float | None = None, num_tokens: float | Tensor | None = None,
                is_weight: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """-J of Eq. 6 (scalar) and detached stats (masked means over this micro-batch's tokens)."""
    m = mask.bool()                                                             # (B, T) or (N,)
    a = advantages if advantages.shape == logp.shape else advantages.unsqueeze(-1)  # broadcast over tokens
    # where() (not a multiply) so garbage log-probs on padding (-inf, NaN) cannot leak into values or grads.
    log_ratio = torch.where(m, logp - old_logp, torch.zeros_like(logp)).clamp(-20.0, 20.0)  # (B, T)
    ratio = log_ratio.exp()                                                     # (B, T)
    loss_unclipped = -a * ratio                                                 # (B, T)
    loss_clipped = -a * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)              # (B, T)
    loss_tok = torch.maximum(loss_unclipped, loss_clipped)                      # (B, T) pessimistic bound
    if dual_clip is not None:
        # For A < 0 a huge ratio makes -A·r unbounded; cap it at -A·c (verl clip_ratio_c).
        loss_tok = torch.where(a < 0, torch.minimum(loss_tok, -a * dual_clip), loss_tok)
    if is_weight is not None:
        loss_tok = loss_tok * is_weight.detach()                                # a constant weight: no gradient
    loss = masked_token_mean(loss_tok, m, num_tokens)

    with torch.no_grad():
        clipped = (loss_clipped > loss_unclipped) & m                           # (B, T) the clip branch binds
        stats = {
            "clip_frac_high": masked_token_mean((clipped & (ratio > 1)).float(), m),
            "clip_frac_low": masked_token_mean((clipped & (ratio < 1)).float(), m),
            "approx_kl": masked_token_mean(ratio - 1 - log_ratio, m),           # k3 estimate of KL(old || new)
            "ratio_mean": masked_token_mean(ratio, m),
        }
        if dual_clip is not None:
            stats["dual_clip_frac"] = masked_token_mean(((a < 0) & (ratio > dual_clip)).float(), m)
    return loss, stats


def truncated_is_weight(old_logp: Tensor, engine_logp: Tensor, cap: float) -> Tensor:
    """min(π_old / π_engine, C) per token (TIS): corrects for the sampler's numerics differing from the trainer's."""
    return torch.minimum(old_logp - engine_logp, torch.full_like(old_logp, math.log(cap))).exp()


def truncated_is_clip_frac(old_logp: Tensor, engine_logp: Tensor, cap: float) -> Tensor:
    """The share of tokens whose π_old / π_engine exceeds C, so that truncated_is_weight cut it."""
    return (old_logp.float() - engine_logp > math.log(cap)).float().mean()


# Optional regularisers, off in the paper's recipe (no KL, no entropy bonus). The caller adds coef * term.

def kl_penalty(logp: Tensor, ref_logp: Tensor, mask: Tensor, kind: str = "k3",
               num_tokens: float | Tensor | None = None) -> Tensor:
    """Token-mean estimate of KL(π_θ || π_ref) from sampled tokens (Schulman's k1/k2/k3)."""
    d = torch.where(mask.bool(), ref_logp - logp, torch.zeros_like(logp))      # (B, T) log(π_ref / π_θ)
    per_tok = {"k1": lambda: -d, "k2": lambda: 0.5 * d * d, "k3": lambda: d.clamp(-20, 20).exp() - 1 - d}[kind]()
    return masked_token_mean(per_tok, mask, num_tokens)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Per-token entropy H = logsumexp(z) - Σ_v softmax(z)_v z_v of softmax(logits), float32: (..., V) -> (...)."""
    x = logits.float()
    return torch.logsumexp(x, -1) - (x.softmax(-1) * x).sum(-1)
