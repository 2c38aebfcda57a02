"""Non-reasoning SFT (paper §4.1) of any chat model: next-token loss on assistant tokens only; prompts, generation
headers and tool responses are masked.

Transcripts are chat messages (rstar2.training.transcripts: the common messages layout with tool calls), rendered with
the model's own chat template as the token streams RL rolls out (rstar2.rollout.chat.ChatFormat.segments), tokenised
segment by segment (the rollout tokenises its prompt, the model's turns and the tool turns apart too). Batches are
right-padded buckets of similar length, or packed rows (`packed`: the opening that transcripts share, the system turn
with its tools block, stored and computed once a row), both through rstar2.training.batching as the RL trainer's;
the LM head runs only on the hidden states that predict an assistant token (about 40% of positions in the tiny
world's transcripts)."""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from transformers import AutoModelForCausalLM

from rstar2.core import adapter, checkpoint
from rstar2.core.config import RunCfg, SFTCfg
from rstar2.core.progress import bar
from rstar2.models import tools
from rstar2.rollout.chat import ChatFormat
from rstar2.training import device as dev
from rstar2.training import numerics, optim, transcripts
from rstar2.training.batching import collate, loss_token_logprobs, pack_rows, token_budget_batches, use_varlen_attention


@dataclass
class SFTResult:
    steps: int
    final_loss: float  # a 10-step EMA of the loss at the end
    tokens_per_s: float
    wall_s: float
    cycle_losses: list[float] = field(default_factory=list)  # each cycle's final loss (train_with)
    fed_tokens: int = 0  # positions computed (padding included), and the assistant tokens the loss is on
    loss_tokens: int = 0
    dtype: str = "float32"  # the numerics it ran in (trainer.dtype resolved: rstar2.training.numerics)


def tokenize(chat: ChatFormat, conversations: list[list[dict]]) -> tuple[list[list[int]], list[list[int]]]:
    """Token ids and loss masks of transcripts, rendered with the model's chat template and tokenised segment by
    segment (no re-tokenisation drift at boundaries), all segments in one batched call (the fast tokenizer's)."""
    segs = [chat.segments(messages) for messages in conversations]
    texts = [text for s in segs for text, _ in s]
    flat = iter(chat.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else [])
    ids, masks = [], []
    for s in segs:
        seg_ids = [next(flat) for _ in s]
        ids.append([t for seg in seg_ids for t in seg])
        masks.append([int(train) for seg, (_, train) in zip(seg_ids, s) for _t in seg])
    return ids, masks


# The loss that ends a WSD schedule's held phase: an average over ~50 steps (an EMA), as one batch's loss swings with
# its length bucket (a cycle's final loss, a 10-step EMA, moved between 0.09 and 0.17 within 35 steps of a formed model)
SLOW = 0.98
MIN_SHARED = 32  # tokens: a shorter common opening is not worth storing once


def shared_openings(ids: list[list[int]], masks: list[list[int]]) -> tuple[list[int], list[int]]:
    """(prefix length, group) per transcript: transcripts that open with the same untrained tokens (the system turn
    and its tools block, the same text in every transcript that has it) form a group, and their common opening, up
    to the first trained token of any member, is what a packed row stores and computes once for the group's members
    in it (rstar2.training.batching.collate); the rest of a transcript attends to that copy. A transcript that
    shares fewer than MIN_SHARED tokens with every group is a group of its own (prefix 0)."""
    first = [m.index(1) if 1 in m else len(m) for m in masks]
    reps: list[list[int]] = []  # [representative, common length] per group
    group = []
    for i, x in enumerate(ids):
        for g, (r, p) in enumerate(reps):
            n = 0
            limit = min(p, first[i])
            while n < limit and x[n] == ids[r][n]:
                n += 1
            if n >= MIN_SHARED:
                reps[g][1] = n
                group.append(g)
                break
        else:
            reps.append([i, first[i]])
            group.append(len(reps) - 1)
    sizes = [group.count(g) for g in range(len(reps))]
    return [reps[g][1] if sizes[g] > 1 else 0 for g in group], group


def _batches(lengths: list[int], batch_tokens: int, packed: bool, rng: random.Random | None = None,
             openings: tuple[list[int], list[int]] | None = None) -> list[list[int]]:
    """One pass over the data: buckets of similar length, or packed rows in a shuffled order (each group's common
    opening counted once a row: `shared_openings`)."""
    if not packed:
        return token_budget_batches(lengths, batch_tokens, rng)
    rows = pack_rows(lengths, batch_tokens, *(openings or (None, None)))
    if rng is not None:
        rng.shuffle(rows)
    return rows


def train(model_dir: Path, data: Path, out_dir: Path, s: SFTCfg, *, seed: int, device: str = "auto",
          dtype: str = "float32", on_progress: Callable[[int, int, float], None] | None = None) -> SFTResult:
    """SFT of the model in `model_dir` on the transcripts in `data` (JSON lines, rstar2.training.transcripts); the model
    and its tokenizer are saved to `out_dir` (a plain HF model directory). dtype "auto": rstar2.training.numerics.
    `s.lora`: only low-rank adapters train (the base frozen, in fp32), merged into the weights saved."""
    torch.manual_seed(seed)
    chat = ChatFormat.load(model_dir)
    tok = chat.tokenizer
    dv = dev.pick(device)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(dv)
    adapted = adapter.attach(model, s.lora, str(model_dir)).to(dv) if s.lora else None
    ids, masks = tokenize(chat, transcripts.read(data))
    res = fit(model, ids, masks, s, seed=seed, dtype=numerics.choose(dtype, dv).dtype, pad_id=_pad_id(tok),
              on_progress=on_progress)
    if adapted is not None:
        model = adapted.merge_and_unload()  # W + (alpha / rank) B A: a plain model again
    model.set_attn_implementation("sdpa")  # the saved model loads anywhere, not only where varlen is registered
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tok.save_pretrained(str(out_dir))
    tools.carry(model_dir, out_dir)  # what rstar2 gave the model (its tool template) goes with it
    return res


def batches_per_epoch(ids: list[list[int]], masks: list[list[int]], batch_tokens: int, packed: bool) -> int:
    """How many optimizer steps one pass over these transcripts takes (what `fit`'s `epochs` multiplies)."""
    return len(_batches([len(x) for x in ids], batch_tokens, packed, None,
                        shared_openings(ids, masks) if packed else None))


def fit(model, ids: list[list[int]], masks: list[list[int]], s: SFTCfg, *, seed: int, dtype: str, pad_id: int,
        on_progress: Callable[[int, int, float], None] | None = None) -> SFTResult:
    """The optimisation itself, on tokenised transcripts (ids and loss masks), in place on `model` (on its device):
    AdamW, `dtype` autocast, a budget of int(batches per epoch x s.epochs) steps, and the schedule `optim.schedule`:
    linear warm-up, then a cosine to s.min_lr_frac x s.lr over the whole budget (decay_frac 1: the paper's SFT
    schedule), or the lr held until its last s.decay_frac of the budget and the cosine there (WSD). With
    s.decay_at_target, the held phase ends as soon as the loss average (`SLOW`) falls to s.target_loss: the decay
    follows and the cycle ends early."""
    rng = random.Random(seed)
    dv = next(model.parameters()).device
    use_varlen_attention(model)  # packed rows' segments; plain SDPA otherwise (fp32 under bf16 on a CPU)
    lengths = [len(x) for x in ids]
    openings = shared_openings(ids, masks) if s.packed else None
    total = max(1, int(len(_batches(lengths, s.batch_tokens, s.packed, None, openings)) * s.epochs))
    decay = max(1, int(total * s.decay_frac))
    decay_at_loss = s.target_loss if s.decay_at_target else None
    params = adapter.trainable(model)  # every weight, or a LoRA adapter's
    opt = optim.adamw(params, s.lr, s.weight_decay, dv, betas=(0.9, 0.95))
    warm = max(1, int(total * s.warmup_frac))
    multiplier = optim.schedule(warm, decay, s.min_lr_frac, stable_steps=total - decay)
    model.train()
    step, tokens, fed, n_loss, t0, loss_ema, loss_sum = 0, 0, 0, 0, time.perf_counter(), float("nan"), 0.0
    while step < total:
        for batch in _batches(lengths, s.batch_tokens, s.packed, rng, openings):
            if step >= total:
                break
            mb = collate(ids, masks, batch, pad_id, s.packed,  # (B, T) rows or (1, T) packed; N loss tokens
                         openings[0] if s.packed else None).to(dv)
            with dev.autocast(dv, dtype):
                logp, _ = loss_token_logprobs(model, mb)  # (N,)
            loss = -logp.mean() if logp.numel() else logp.sum()  # mean over assistant tokens
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            for group in opt.param_groups:
                group["lr"] = s.lr * multiplier(step)
            opt.step()
            step += 1
            tokens, fed, n_loss = tokens + mb.real_tokens, fed + mb.fed_tokens, n_loss + logp.numel()
            x = loss.item()
            loss_ema = x if math.isnan(loss_ema) else 0.9 * loss_ema + 0.1 * x
            loss_sum = SLOW * loss_sum + (1 - SLOW) * x
            loss_avg = loss_sum / (1 - SLOW ** step)  # bias-corrected, as Adam's moments: a mean early on
            if decay_at_loss is not None and warm < step < total - decay and loss_avg <= decay_at_loss:
                total = step + decay  # the skill has formed: decay from here, and end after it
                multiplier = optim.schedule(warm, decay, s.min_lr_frac, stable_steps=step)
            if on_progress:
                on_progress(step, total, loss_ema)
    wall = time.perf_counter() - t0
    return SFTResult(steps=step, final_loss=loss_ema, tokens_per_s=tokens / wall, wall_s=wall, fed_tokens=fed,
                     loss_tokens=n_loss, dtype=dtype)


def train_with(cfg: RunCfg, model_dir: Path, data: Path, out_dir: Path,
               on_progress: Callable[[int, int, float], None] | None = None) -> SFTResult:
    """`train` with a run's settings: sft.*, the run's seed, the trainer's device and dtype; in cycles while the loss
    ends above sft.target_loss (up to sft.max_cycles), cycle c from the model cycle c-1 saved, its batches in the order
    of seed + c. How long a skill takes to form is a draw of the data and the host: a cycle budget in epochs alone
    leaves some draws without it (docs/findings.md, "Over world seeds")."""
    s, src, cycles = cfg.sft, Path(model_dir), []
    while True:
        done = sum(r.steps for r in cycles)  # progress counts on through the cycles
        progress = on_progress and (lambda step, total, loss, done=done: on_progress(done + step, done + total, loss))
        res = train(src, Path(data), Path(out_dir), s, seed=cfg.seed + len(cycles), device=cfg.trainer.device,
                    dtype=cfg.trainer.dtype, on_progress=progress)
        cycles.append(res)
        if s.target_loss is None or res.final_loss <= s.target_loss or len(cycles) == s.max_cycles:
            break
        src = Path(out_dir)  # the next cycle starts from the model this one saved
    wall = sum(r.wall_s for r in cycles)
    return SFTResult(steps=sum(r.steps for r in cycles), final_loss=res.final_loss,
                     tokens_per_s=sum(r.tokens_per_s * r.wall_s for r in cycles) / wall if wall else 0.0,
                     wall_s=wall, cycle_losses=[r.final_loss for r in cycles],
                     fed_tokens=sum(r.fed_tokens for r in cycles), loss_tokens=sum(r.loss_tokens for r in cycles),
                     dtype=res.dtype)


def train_and_commit(cfg: RunCfg, model_dir: Path, data: Path, out_dir: Path, meta: dict) -> SFTResult:
    """`train_with` into `out_dir`, committed (rstar2.core.checkpoint, `meta` in its manifest) only when training
    finished, its figures beside the model in sft_result.json; progress on a bar. A campaign's SFT task and `rstar2
    sft` both train this way."""
    done: list[SFTResult] = []

    with bar("SFT") as progress:
        def write(tmp: Path) -> None:
            done.append(train_with(cfg, model_dir, data, tmp, progress))
            (tmp / "sft_result.json").write_text(json.dumps(asdict(done[0])))

        checkpoint.commit(out_dir, write, {"kind": "sft", **meta})
    return done[0]


def _pad_id(tok) -> int:
    """Padding fills bucket rows only; a tokenizer without a pad token pads with eos (never a loss token)."""
    return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
