"""Token-budgeted micro-batches: sequences of similar length share a batch, so little compute goes to padding
(on CPU, padded batches of similar lengths beat packing through SDPA masks; see shared trainer notes)."""

from __future__ import annotations

import random
from typing import Sequence

import torch

from rstar2.grpo import token_logprobs


def token_budget_batches(lengths: Sequence[int], max_tokens: int, rng: random.Random | None = None) -> list[list[int]]:
    """Indices grouped so that (longest in batch) x (batch size) <= max_tokens; sorted by length, then the batch
    order is shuffled by `rng` (if given) so training does not see lengths in order."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        if cur and lengths[i] * (len(cur) + 1) > max_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    if rng is not None:
        rng.shuffle(batches)
    return batches


def pad_right(seqs: Sequence[Sequence[int]], pad_value: int, dtype=torch.long) -> torch.Tensor:
    width = max(len(s) for s in seqs)
    out = torch.full((len(seqs), width), pad_value, dtype=dtype)  # (B, T)
    for row, s in enumerate(seqs):
        out[row, : len(s)] = torch.as_tensor(list(s), dtype=dtype)
    return out


def next_token_logprobs(model, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """log p(ids[:, t+1] | ids[:, :t+1]) for every position: (B, T) -> (B, T-1), float32."""
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1]  # (B, T-1, V)
    return token_logprobs(logits, ids[:, 1:])
