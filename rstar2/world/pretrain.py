"""A tiny "pretraining" phase that gives the randomly initialised model what every real base model has: copying.

The paper starts RL from Qwen3-14B-Base, which copies numbers from a problem into code and from tool output into
an answer without effort. A freshly initialised 3M-parameter model cannot, and learns it far too slowly from the SFT
transcripts alone (measured: no copying after ~800 SFT steps). Short sequences that repeat a random span of the
world's tokens ("... a b c d ... a b c d") form induction heads within a few hundred steps; SFT then reuses them.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path
from typing import Callable

import torch
from transformers import AutoModelForCausalLM

from rstar2.batching import next_token_logprobs, pad_right
from rstar2.world.tokenizer import load as load_tokenizer


def copy_batch(vocab: list[int], batch: int, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) ids of `noise span noise span` and the (B, T-1) mask that trains only the repeated span."""
    seqs, masks = [], []
    for _ in range(batch):
        span = [rng.choice(vocab) for _ in range(rng.randint(3, 12))]
        gap = [rng.choice(vocab) for _ in range(rng.randint(1, 24))]
        lead = [rng.choice(vocab) for _ in range(rng.randint(0, 8))]
        seqs.append(lead + span + gap + span)
        masks.append([0] * (len(lead) + len(span) + len(gap) + 1) + [1] * (len(span) - 1))
    return pad_right(seqs, 0), pad_right([m[1:] for m in masks], 0).float()


def train_copy(model_dir: Path, out_dir: Path, steps: int, batch: int, lr: float, seed: int,
               on_progress: Callable[[int, int, float], None] | None = None) -> dict:
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    vocab = [i for t, i in tok.get_vocab().items() if i not in tok.all_special_ids]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(1, steps // 20)) * 0.5 * (1 + math.cos(math.pi * s / steps)))
    model.train()
    t0, acc = time.perf_counter(), 0.0
    for step in range(steps):
        ids, mask = copy_batch(vocab, batch, rng)
        attn = (torch.arange(ids.size(1))[None, :] < (ids != 0).cumsum(1).argmax(1, keepdim=True) + 1).long()
        logp = next_token_logprobs(model, ids, attn)  # (B, T-1)
        loss = -(logp * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        acc = float(((logp > math.log(0.5)).float() * mask).sum() / mask.sum())  # share copied with p > 0.5
        if on_progress:
            on_progress(step + 1, steps, float(loss))
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tok.save_pretrained(str(out_dir))
    return {"steps": steps, "copy_accuracy": acc, "wall_s": time.perf_counter() - t0}
