"""Micro-batches sized by tokens, and the forward pass that computes only what the loss needs.

Two layouts, both with no attention mask at all:
  bucket: sequences sorted by length, cut into micro-batches of (longest x count) <= budget tokens, right-padded.
          Under a causal mask a real token never attends to the padding after it, so no padding mask is needed and
          SDPA takes its fused is_causal kernel; the only waste is each sequence's tail up to its batch's longest.
  pack:   sequences concatenated into rows of <= budget tokens (first-fit decreasing), position ids restarting
          per sequence, attention run per segment by `varlen_attention` (zero padding). The rollouts of one prompt
          (a GRPO group) go into a row together and store their shared prompt once: every completion attends to
          that one copy, so the prompt's forward and backward run once per group instead of once per rollout.
The LM head runs only on the hidden states that predict a loss token (not on prompt, tool output or padding):
for a small model most FLOPs are the vocabulary projection. Measured on the 2-core CPU in bench/README.md
("Trainer update"; `rstar2 bench trainer --layouts bucket,pack` reruns the comparison).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from rstar2.training.grpo import entropy_from_logits

VARLEN = "rstar2_varlen"  # the attention implementation name registered for packed rows


@dataclass
class MicroBatch:
    ids: Tensor          # (R, T) token ids, right-padded (bucket) or packed rows (pack)
    pos: Tensor | None   # (R, T) position ids restarting per sequence (pack); None = 0..T-1 (bucket)
    src: Tensor          # (N,) flat index into R*T of the hidden state that predicts each loss token
    tgt: Tensor          # (N,) the loss tokens themselves
    seq: Tensor          # (N,) index (into the caller's sequence list) of the sequence each loss token is in
    tok: Tensor          # (N,) position of the loss token within its sequence (for per-token side inputs)
    segments: list | None  # pack: per row, (start, end, prefix_start, prefix_end) spans for varlen_attention
    fed_tokens: int      # R*T positions the model computes, padding included
    real_tokens: int     # Σ L_i (a shared prompt counted once per sequence)

    def to(self, device) -> "MicroBatch":
        mv = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return MicroBatch(mv(self.ids), mv(self.pos), mv(self.src), mv(self.tgt), self.seq, self.tok, self.segments,
                          self.fed_tokens, self.real_tokens)


def token_budget_batches(lengths: Sequence[int], max_tokens: int, rng: random.Random | None = None) -> list[list[int]]:
    """bucket layout: indices grouped so that (longest in batch) x (batch size) <= max_tokens; sorted by length,
    then the batch order is shuffled by `rng` (if given) so training does not see lengths in order."""
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


def pack_rows(lengths: Sequence[int], max_tokens: int, prompt_lens: Sequence[int] | None = None,
              groups: Sequence | None = None) -> list[list[int]]:
    """pack layout: first-fit decreasing into rows of <= max_tokens (a longer unit gets a row of its own). With
    `groups` (rollouts of one prompt share a key) and `prompt_lens`, a group's rollouts travel together and their
    prompt is counted once: a unit is one prompt plus as many of its completions as fit."""
    units: list[tuple[int, list[int]]] = []  # (tokens, member indices)
    by_group: dict = {}
    for i in range(len(lengths)):
        by_group.setdefault(groups[i] if groups is not None else i, []).append(i)
    for members in by_group.values():
        p = prompt_lens[members[0]] if groups is not None and prompt_lens is not None else 0
        cur, size = [], p
        for i in sorted(members, key=lambda i: -lengths[i]):
            if cur and size + lengths[i] - p > max_tokens:
                units.append((size, cur))
                cur, size = [], p
            cur.append(i)
            size += lengths[i] - p
        units.append((size, cur))
    rows: list[list[int]] = []
    free: list[int] = []
    for size, members in sorted(units, key=lambda u: -u[0]):
        r = next((r for r, f in enumerate(free) if f >= size), None)
        if r is None:
            rows.append(list(members))
            free.append(max_tokens - size)
        else:
            rows[r] += members
            free[r] -= size
    return rows


def shard(lengths: Sequence[int], world: int, rank: int) -> list[int]:
    """This rank's share of a batch: longest first to the least-loaded rank (tokens balanced, deterministic)."""
    load, owner = [0] * world, {}
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i], load[r] = r, load[r] + lengths[i]
    return [i for i in range(len(lengths)) if owner[i] == rank]


def collate(ids: Sequence[Sequence[int]], loss_mask: Sequence[Sequence[int]], idx: Sequence[int], pad_id: int,
            packed: bool, prompt_lens: Sequence[int] | None = None) -> MicroBatch:
    """One micro-batch of sequences `idx`: right-padded rows (one per sequence), or one packed row. When packing
    with `prompt_lens`, a sequence whose prompt equals the previous one's is stored without it and attends to the
    stored copy (GRPO rollouts of one prompt: the prompt is computed once per micro-batch, not once per rollout).
    loss_mask[i][t] = 1 where token t of sequence i is trained on (the model's own tokens)."""
    lens = [len(ids[i]) for i in idx]
    src, tgt, seq, tok = [], [], [], []
    if not packed:
        R, T = len(idx), max(lens)
        x = torch.full((R, T), pad_id, dtype=torch.long)                                      # (R, T)
        for r, (i, n) in enumerate(zip(idx, lens)):
            x[r, :n] = torch.as_tensor(ids[i])
            t = _loss_positions(loss_mask[i])                                                  # (n_i,) in 1..n-1
            src.append(r * T + t - 1)   # hidden state t-1 predicts token t
            tgt.append(x[r, t]), seq.append(torch.full_like(t, i)), tok.append(t)
        return MicroBatch(x, None, torch.cat(src), torch.cat(tgt), torch.cat(seq), torch.cat(tok), None, R * T,
                          sum(lens))
    pieces, pos, segments = [], [], []
    off, prev = 0, None                                                      # prev: (prompt ids, start, P)
    for i in idx:
        p = prompt_lens[i] if prompt_lens is not None else 0
        full = list(ids[i])
        if prev is not None and p and p == prev[2] and full[:p] == prev[0]:
            ps, body = prev[1], full[p:]                                     # reuse the stored prompt at ps..ps+p
            segments.append((off, off + len(body), ps, ps + p))
            loc = lambda t, ps=ps, p=p, off=off: torch.where(t < p, ps + t, off + t - p)  # noqa: E731
            pos.append(torch.arange(p, p + len(body)))
        else:
            body = full
            segments.append((off, off + len(body), off, off))
            if p:
                prev = (full[:p], off, p)
            loc = lambda t, off=off: off + t  # noqa: E731
            pos.append(torch.arange(len(body)))
        pieces.append(torch.as_tensor(body, dtype=torch.long))
        t = _loss_positions(loss_mask[i])
        src.append(loc(t - 1)), tgt.append(torch.as_tensor(full)[t]), seq.append(torch.full_like(t, i)), tok.append(t)
        off += len(body)
    x = torch.cat(pieces).unsqueeze(0)                                                         # (1, T)
    return MicroBatch(x, torch.cat(pos).unsqueeze(0), torch.cat(src), torch.cat(tgt), torch.cat(seq), torch.cat(tok),
                      [segments], off, sum(lens))


def _loss_positions(mask: Sequence[int]) -> Tensor:
    """Positions t >= 1 whose token is trained on (token 0 has no predecessor, and is always prompt)."""
    return torch.nonzero(torch.as_tensor(mask[1:], dtype=torch.bool)).flatten() + 1          # (n_i,)


def hidden_states(model, mb: MicroBatch) -> Tensor:
    """Final hidden states of the decoder body (no LM head): (R, T, H). `model` is a *ForCausalLM."""
    extra = {"rstar2_segments": mb.segments} if mb.segments is not None else {}
    return model.model(input_ids=mb.ids, position_ids=mb.pos, use_cache=False, **extra).last_hidden_state


def loss_token_logprobs(model, mb: MicroBatch, with_entropy: bool = False,
                        entropy_grad: bool = True) -> tuple[Tensor, Tensor | None]:
    """log π(tgt) at the loss positions only, float32 (N,); entropy (N,) of those positions if asked, from the same
    logits (no second forward). entropy_grad=False: a detached measurement (no graph kept for it)."""
    h = hidden_states(model, mb)                                                              # (R, T, H)
    h = h.reshape(-1, h.shape[-1]).index_select(0, mb.src)                                    # (N, H)
    x = model.lm_head(h).float()                                                              # (N, V)
    logp = -F.cross_entropy(x, mb.tgt, reduction="none")                                      # (N,)
    if not with_entropy:
        return logp, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        return logp, entropy_from_logits(x)                                                   # (N,)


def varlen_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, scaling=None, dropout=0.0,
                     rstar2_segments=None, **kwargs) -> tuple[Tensor, None]:
    """Causal attention per packed segment: q (B, Hq, T, D), k/v (B, Hkv, T, D) -> (B, T, Hq, D). A segment
    (s, e, ps, pe) attends causally to itself after the prefix span ps..pe (its shared prompt; empty if ps == pe).
    Exact: each sequence sees only its own tokens, as if run alone. Without segments (an ordinary forward of the
    same model, e.g. a reference or generation call) it is plain SDPA attention. Under bf16 autocast on a CPU it
    computes in fp32: torch's CPU flash attention ran its backward ~2.5x slower in bf16 than in fp32 (a ~3M model's
    SFT step: 236 ms against 93; bench/README.md, "Trainer roofline"), and fp32 is the more exact of the two."""
    if query.device.type == "cpu" and torch.is_autocast_enabled("cpu"):  # q, k, v come fp32 out of RoPE
        with torch.autocast("cpu", enabled=False):
            return varlen_attention(module, query.float(), key.float(), value.float(), attention_mask, scaling,
                                    dropout, rstar2_segments, **kwargs)
    if rstar2_segments is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    out = torch.empty_like(query)                                                             # (B, Hq, T, D)
    gqa = query.shape[1] != key.shape[1]
    for b, segs in enumerate(rstar2_segments):
        for s, e, ps, pe in segs:
            q, k, v = query[b:b + 1, :, s:e], key[b:b + 1, :, s:e], value[b:b + 1, :, s:e]
            mask = None
            if pe > ps:  # prepend the shared prompt's keys/values; causal mask offset by its length
                k = torch.cat([key[b:b + 1, :, ps:pe], k], dim=2)
                v = torch.cat([value[b:b + 1, :, ps:pe], v], dim=2)
                mask = torch.ones(e - s, pe - ps + e - s, dtype=torch.bool, device=q.device).tril(pe - ps)
            out[b:b + 1, :, s:e] = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                                  scale=scaling, dropout_p=dropout, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


def use_varlen_attention(model) -> None:
    """Route `model`'s attention through `varlen_attention` (registered once; no mask is ever built for it): packed
    rows need it, and every training forward takes its CPU bf16 path."""
    from transformers import AttentionInterface

    if VARLEN not in AttentionInterface._global_mapping:
        AttentionInterface.register(VARLEN, varlen_attention)
    model.set_attn_implementation(VARLEN)
