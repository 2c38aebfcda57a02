"""Non-reasoning SFT (paper §4.1): next-token loss on assistant tokens only; prompts and tool responses are masked.

Batches are right-padded buckets of similar length (rstar2.batching, as the RL trainer's), and the LM head runs only
on the hidden states that predict an assistant token: about 40% of positions in the tiny world's transcripts."""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import polars as pl
import torch
from transformers import AutoModelForCausalLM

from rstar2 import device as dev
from rstar2.batching import collate, loss_token_logprobs, token_budget_batches
from rstar2.world.tokenizer import load as load_tokenizer


@dataclass
class SFTResult:
    steps: int
    final_loss: float
    tokens_per_s: float
    wall_s: float


def tokenize_segments(tokenizer, texts: list[str], trainable: list[bool]) -> tuple[list[int], list[int]]:
    """Token ids and loss mask of one transcript, segment by segment (no re-tokenisation drift at boundaries)."""
    ids: list[int] = []
    mask: list[int] = []
    for text, train in zip(texts, trainable):
        seg = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += seg
        mask += [int(train)] * len(seg)
    return ids, mask


def train(model_dir: Path, sft_parquet: Path, out_dir: Path, *, epochs: float, lr: float, batch_tokens: int,
          warmup_frac: float, seed: int, device: str = "auto", dtype: str = "float32",
          on_progress: Callable[[int, int, float], None] | None = None) -> SFTResult:
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok = load_tokenizer(model_dir)
    dv = dev.pick(device)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(dv)
    rows = pl.read_parquet(sft_parquet).select("texts", "trainable").rows()
    data = [tokenize_segments(tok, list(t), list(m)) for t, m in rows]
    ids, masks = [d[0] for d in data], [d[1] for d in data]
    lengths = [len(x) for x in ids]
    n_batches = len(token_budget_batches(lengths, batch_tokens))
    total = max(1, int(n_batches * epochs))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    warm = max(1, int(total * warmup_frac))
    sched = torch.optim.lr_scheduler.LambdaLR(  # linear warm-up, cosine decay (the paper's SFT schedule)
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))
    model.train()
    step, tokens, t0, loss_ema = 0, 0, time.perf_counter(), float("nan")
    while step < total:
        for batch in token_budget_batches(lengths, batch_tokens, rng):
            if step >= total:
                break
            mb = collate(ids, masks, batch, tok.pad_token_id, packed=False).to(dv)  # (B, T) rows, N loss tokens
            with dev.autocast(dv, dtype):
                logp, _ = loss_token_logprobs(model, mb)  # (N,)
            loss = -logp.mean() if logp.numel() else logp.sum()  # mean over assistant tokens
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            tokens += mb.real_tokens
            loss_ema = loss.item() if math.isnan(loss_ema) else 0.9 * loss_ema + 0.1 * loss.item()
            if on_progress:
                on_progress(step, total, loss_ema)
    wall = time.perf_counter() - t0
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tok.save_pretrained(str(out_dir))
    return SFTResult(steps=step, final_loss=loss_ema, tokens_per_s=tokens / wall, wall_s=wall)
