"""The policy trainer: GRPO-RoC updates (rstar2/training/grpo.py) on the RoC-kept rollouts. A Ray actor
(rstar2/run/controller.py): one for the plain-torch backend (CPU or one GPU), one per rank for DeepSpeed ZeRO-2/3
(rstar2/training/trainer_group.py; a rank per GPU, or CPU rank processes: rstar2/training/deepspeed_backend.py).

One RL step (paper §2.2.3):
  1. advantages per prompt over the kept rollouts (Eq. 7);
  2. `mini_batches` optimizer steps (paper: 1, strictly on-policy), each accumulating gradients over micro-batches of
     at most `micro_batch_tokens` tokens (rstar2/training/batching.py: no compute on padding, LM head on loss tokens
     only);
  3. the gradient clipped to norm `grad_clip` (1.0), AdamW with a linear warm-up then a constant lr (paper: 1e-6,
     20 steps), or then a cosine decay over `decay_steps` (the tiny preset's, see its comment).

Old log-probs. "recompute" (default, as verl): the trainer's own log-probs under the pre-update weights. With one
optimizer step per RL step they are the log-probs of the gradient forward itself (same weights, same micro-batch), so
they are taken from it, detached, instead of running the same forward twice; with several mini-batches a no-grad
pass computes them before the first step. "engine": the rollout engine's sampling log-probs (column
`response_logprobs`), so the PPO ratio π_θ/π_engine is the importance weight of the off-policy samples (no recompute
pass). `tis_cap` adds truncated importance sampling, min(π_old/π_engine, C) per token, on top of "recompute".

The rollout/train mismatch. Whenever the rollout recorded the engine's log-probs, each update measures
    logprob_gap = mean over the batch's loss tokens of |log π_old(token) - log π_engine(token)|
(π_old as above): noise when the engines sampled from the trainer's weights, more when they kept older weights or
read the tokens another way. Measured on the tiny campaign (fp32 engine and trainer): 6e-8 to 1.4e-7 nats, and
0.008 to 0.029 for an engine one step behind; its preset's cap is 1e-3. A bf16 engine's own noise is larger, so a
GPU preset's cap catches gross mismatches (shifted tokens, another dtype, weights many steps old), not one missed step.
Past `max_logprob_gap` the controller stops the step before its checkpoint (check_logprob_gap).

LoRA (trainer.lora, rstar2.core.adapter): the model's adapted linear layers get low-rank adapters, the base weights
are frozen, and the optimizer, the gradient clip, the checkpoint's weights and the engines' sync are the adapter's
alone; the KL reference is the same model with the adapter switched off. A run resumes from an adapter checkpoint as
from any other.

Full state (weights, optimizer, LR schedule, RNGs, optimizer step, data position meta) is committed atomically in one
checkpoint directory (each rank's RNGs in its own file); `load_state` of it followed by one more update reproduces the
uninterrupted run bit for bit (CPU; 1 rank or N DeepSpeed ranks, tests/engine/test_zero_ranks.py).
"""

from __future__ import annotations

import contextlib
import copy
import json
import random
import time
from pathlib import Path

import numpy as np
import polars as pl
import torch

from rstar2.core import adapter, checkpoint, weight_bus
from rstar2.core.config import TrainerCfg
from rstar2.core.net import free_port
from rstar2.models import tools
from rstar2.rollout.chat import load_tokenizer
from rstar2.training import device as dev
from rstar2.training import grpo, numerics
from rstar2.training.batching import (
    collate,
    loss_token_logprobs,
    pack_rows,
    shard,
    token_budget_batches,
    use_varlen_attention,
)
from rstar2.training.optim import adamw, lr_lambda

STATE_FILE = "trainer_state.pt"


class TorchBackend:
    """Plain torch: fp32 master weights, bf16 autocast where configured, AdamW + warm-up, grad-clip. With LoRA
    (`adapted`: the peft wrapper of `model`) the optimizer, the gradient clip and the checkpoint's weights are the
    adapter's alone (rstar2.core.adapter)."""

    def __init__(self, model: torch.nn.Module, cfg: TrainerCfg, device: torch.device, adapted=None):
        self.module, self.cfg, self.device, self.adapted = model, cfg, device, adapted
        self.params = adapter.trainable(model)  # every weight, or the adapter's under LoRA
        self.reset_optimizer()

    def reset_optimizer(self) -> None:
        self.opt = adamw(self.params, self.cfg.lr, self.cfg.weight_decay, self.device)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(self.cfg))

    def forward_starts(self) -> None:
        pass

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> float:
        gn = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return float(gn)

    def lr(self) -> float:
        return self.sched.get_last_lr()[0]

    def state_dict(self) -> dict:
        return {"optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict()}

    def load_state_dict(self, sd: dict, ckpt_dir: Path) -> None:
        if self.adapted is not None:
            adapter.load_weights(self.adapted, ckpt_dir)
        else:
            _load_hf_weights(self.module, ckpt_dir)
        self.opt.load_state_dict(sd["optimizer"])
        self.sched.load_state_dict(sd["scheduler"])

    def write(self, tmp: Path, rank: int) -> None:
        (self.adapted or self.module).save_pretrained(str(tmp), safe_serialization=True)  # LoRA: the adapter alone


def _load_hf_weights(model: torch.nn.Module, ckpt_dir: Path) -> None:
    """Weights from a save_pretrained directory into the live model (the optimizer keeps its parameter objects)."""
    from safetensors.torch import load_file

    index = ckpt_dir / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file()
             else ["model.safetensors"])
    sd = {k: v for f in files for k, v in load_file(str(ckpt_dir / f)).items()}
    res = model.load_state_dict(sd, strict=False)
    tied = set(getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or {})
    if res.unexpected_keys or set(res.missing_keys) - tied:
        raise ValueError(f"{ckpt_dir}: weights do not match the model (missing {res.missing_keys}, "
                         f"unexpected {res.unexpected_keys})")


class PolicyTrainer:
    def __init__(self, model_dir: str, cfg: TrainerCfg, seed: int = 0, threads: int | None = None,
                 rank: int = 0, world_size: int = 1, master: tuple[str, int] | None = None):
        if threads:
            torch.set_num_threads(threads)
        torch.manual_seed(seed)
        self.device = dev.pick(cfg.device)
        # auto: a run settles it before it starts (its config.json states it); a direct caller's is settled here
        cfg = cfg.model_copy(update={"dtype": numerics.choose(cfg.dtype, self.device).dtype})
        self.cfg, self.seed, self.rank, self.world = cfg, seed, rank, world_size
        self.tokenizer = load_tokenizer(model_dir)
        self.model_dir = model_dir  # its record (rstar2.models.tools) goes into every checkpoint
        adapted = None
        if cfg.backend == "deepspeed":
            from rstar2.training import deepspeed_backend as dsb
            dsb.init_distributed(rank, world_size, master)
            with dsb.partitioned_construction(cfg, self.device):  # ZeRO-3: the model is built partitioned (zero.Init)
                model = load_model(model_dir, self.device, cfg)
        elif world_size != 1:
            raise ValueError("trainer.backend=torch runs one process; use backend=deepspeed for world_size > 1")
        else:
            model, adapted = load_policy(model_dir, self.device, cfg)
        # KL needs a frozen reference policy: the weights this trainer started from (not under ZeRO-3: see config);
        # under LoRA the base with the adapter switched off (`_reference`), no second copy
        self.ref = copy.deepcopy(model).eval().requires_grad_(False) if cfg.kl_coef and not adapted else None
        self.backend = dsb.DeepSpeedBackend(model, cfg, self.device, rank) if cfg.backend == "deepspeed" \
            else TorchBackend(model, cfg, self.device, adapted)
        self.rng = random.Random(seed)  # mini-batch shuffles: identical on every rank
        self.step = 0  # optimizer steps taken

    @property
    def model(self) -> torch.nn.Module:
        return self.backend.module

    @property
    def adapted(self):
        """LoRA: the peft wrapper of the model (its adapter is what trains and is saved); None without LoRA."""
        return self.backend.adapted

    def reset_optimizer(self) -> None:
        """Fresh AdamW state and warm-up, as the recipe does between stages."""
        self.backend.reset_optimizer()

    # ------------------------------------------------------------------ update
    def update(self, batch_parquet: str) -> dict:
        """One RL step on the kept rollouts (columns: problem_id, reward, prompt_ids, response_ids, loss_mask,
        truncated; response_logprobs when the config uses engine log-probs). Returns scalar metrics."""
        t0 = time.perf_counter()
        dev.reset_peak_memory(self.device)
        df = pl.read_parquet(batch_parquet)
        if df.height == 0:
            return {"skipped": 1.0, "update_s": 0.0, "update_tokens": 0}  # every group was all-equal: no signal
        b = _Batch.from_frame(df, self.cfg)
        c, n = self.cfg, df.height
        order = list(range(n))
        self.rng.shuffle(order)
        minis = [m for m in (order[i:: c.mini_batches] for i in range(c.mini_batches)) if m]
        if c.old_logprobs == "recompute" and len(minis) > 1:
            b.old = self._recompute_old(b)
        acc = _Stats()
        self.model.train()
        for mini in minis:
            n_tok = int(b.n_loss[mini].sum())  # Eq. 6 normaliser: every loss token of the mini-batch, all ranks
            n_seq = int((b.n_loss[mini] > 0).sum())  # seq-mean-token-mean's: the trajectories that have loss tokens
            if n_tok == 0:
                continue  # e.g. the overlong filter masked every rollout
            mine = [mini[j] for j in shard(b.lengths[mini].tolist(), self.world, self.rank)]
            weight = float(self.world)  # ranks' gradients are averaged: undo it so the sum is Eq. 6
            if not mine:  # more ranks than sequences: run one with zero weight so every rank joins the reduction
                mine, weight = mini[:1], 0.0
            for idx in self._plan(b, mine):
                mb = self._collate(b, idx)
                acc.fed += mb.fed_tokens
                acc.real += mb.real_tokens
                self.backend.forward_starts()
                loss, st, n_mb = self._micro_loss(b, mb.to(self.device), n_tok, n_seq)
                self.backend.backward(loss * weight)
                acc.add(loss, st, n_mb, n_tok, weight > 0)
            acc.grad_norm = self.backend.step()
            self.step += 1
        wall = time.perf_counter() - t0
        return acc.metrics(len(minis), wall, self.backend.lr(), float(b.adv.abs().mean()),
                           dev.peak_memory_mb(self.device))

    def _plan(self, b: "_Batch", idx: list[int]) -> list[list[int]]:
        lens = b.lengths[idx].tolist()
        if self.cfg.layout == "pack":
            shared = self.cfg.share_prompts
            plan = pack_rows(lens, self.cfg.micro_batch_tokens, [b.prompt_lens[i] for i in idx] if shared else None,
                             [b.groups[i] for i in idx] if shared else None)
        else:
            plan = token_budget_batches(lens, self.cfg.micro_batch_tokens)
        return [[idx[j] for j in p] for p in plan]

    def _collate(self, b: "_Batch", idx: list[int]):
        pack = self.cfg.layout == "pack"
        return collate(b.ids, b.mask, idx, self.tokenizer.pad_token_id, pack,
                       b.prompt_lens if pack and self.cfg.share_prompts else None)

    def _micro_loss(self, b: "_Batch", mb, n_tok: int, n_seq: int):
        c = self.cfg
        with dev.autocast(self.device, c.dtype):
            # the entropy of the policy at its own sampled tokens is always measured (a collapse signal),
            # from the logits this forward already has; it carries gradient only as the optional bonus term
            logp, ent = loss_token_logprobs(self.model, mb, True, entropy_grad=c.entropy_coef > 0)   # (N,), (N,)
        flat = b.offsets[mb.seq] + mb.tok                                                            # (N,) in b.*_flat
        adv = b.adv[mb.seq].to(self.device)                                                          # (N,)
        engine = b.engine[flat].to(self.device) if b.engine is not None else None                   # (N,)
        old = b.old[flat].to(self.device) if b.old is not None else logp.detach()                    # (N,)
        is_w = grpo.truncated_is_weight(old, engine, c.tis_cap) if c.tis_cap else None
        # the share of tokens whose importance weight the cap cut (a one-version lag, rollout.max_staleness, raises it)
        tis_clipped = grpo.truncated_is_clip_frac(old, engine, c.tis_cap) if c.tis_cap else None
        # the rollout/train mismatch: π_old (the trainer's) against the engine's that sampled the tokens
        gap = (old.float() - engine).abs().mean().detach() if engine is not None else None
        if c.loss_agg == "seq-mean-token-mean":
            # token weight n_tok / (n_seq · |o_i|): with the 1/n_tok of Eq. 6 the loss is mean_i mean_t loss_i,t
            agg = (n_tok / (n_seq * b.n_loss[mb.seq].float())).to(self.device)                      # (N,)
            is_w = agg if is_w is None else is_w * agg
        if c.old_logprobs == "engine":
            old = engine
        ones = torch.ones_like(logp)
        loss, st = grpo.policy_loss(logp, old, adv, ones, c.eps_low, c.eps_high, c.dual_clip, n_tok, is_w)
        if c.kl_coef:
            with torch.no_grad(), dev.autocast(self.device, c.dtype), self._reference() as reference:
                ref, _ = loss_token_logprobs(reference, mb)
            kl = grpo.kl_penalty(logp, ref, ones, c.kl_estimator, n_tok)
            loss, st["kl"] = loss + c.kl_coef * kl, kl.detach() * n_tok / logp.numel()
        if c.entropy_coef:
            loss = loss - c.entropy_coef * ent.sum() / n_tok
        st["entropy"] = ent.detach().mean()  # a micro-batch mean; _Stats weights it by the micro-batch's tokens
        if gap is not None:
            st["logprob_gap"] = gap
        if tis_clipped is not None:
            st["tis_clip_frac"] = tis_clipped
        return loss, st, logp.numel()

    @contextlib.contextmanager
    def _reference(self):
        """The frozen reference policy: the starting weights' copy, or under LoRA the model with its adapter off."""
        if self.adapted is None:
            yield self.ref
        else:
            with self.adapted.disable_adapter():
                yield self.model

    @torch.no_grad()
    def _recompute_old(self, b: "_Batch") -> torch.Tensor:
        """π_old for every loss token, before any weight changes (needed when one RL step takes several steps)."""
        old = torch.zeros_like(b.mask_flat, dtype=torch.float32)                                     # (Σ L,)
        self.model.eval()
        for idx in self._plan(b, list(range(len(b.ids)))):
            mb = self._collate(b, idx)
            with dev.autocast(self.device, self.cfg.dtype):
                lp, _ = loss_token_logprobs(self.model, mb.to(self.device))
            old[b.offsets[mb.seq] + mb.tok] = lp.float().cpu()
        return old

    # ------------------------------------------------------------------ checkpoints
    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The current weights for the engines' in-memory sync, on CPU (rank 0; None on other ranks). Collective
        under DeepSpeed: every rank calls it."""
        if self.adapted is not None:
            return adapter.payload(self.adapted)  # LoRA: the adapter alone (its config and tensors)
        if isinstance(self.backend, TorchBackend):
            return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
        return self.backend.full_state_dict()

    def weight_bus_address(self) -> tuple[str, int]:
        """Where this rank (rank 0) hosts a weight bus's store: its node's address and a free port."""
        import ray

        return ray.util.get_node_ip_address(), free_port("")

    def broadcast_weights(self, bus: weight_bus.Bus, key: int) -> dict | None:
        """trainer.weight_sync=collective: rank 0 sends the current weights to the engines (rstar2.core.weight_bus);
        {"sync_bytes", "sync_buckets", "sync_shared"}, None on other ranks. The torch backend sends from its own
        parameters (no copy), DeepSpeed from rank 0's gathered state dict (every rank takes part in the gather)."""
        weights = self.model.state_dict() if isinstance(self.backend, TorchBackend) else self.backend.full_state_dict()
        return weight_bus.send(bus, key, weights.items(), self.device) if self.rank == 0 else None

    def write_state(self, tmp: str, meta: dict) -> None:
        """Write this rank's part of a checkpoint into `tmp` (the caller commits the directory)."""
        tmp = Path(tmp)
        self.backend.write(tmp, self.rank)
        torch.save(_rng_state(), tmp / f"rng-rank{self.rank}.pt")  # each rank's own RNGs (they may differ)
        if self.rank == 0:
            self.tokenizer.save_pretrained(str(tmp))
            tools.carry(self.model_dir, tmp)
            state = {"backend": self.backend.state_dict(), "trainer_rng": self.rng.getstate(),
                     "step": self.step, "meta": meta}
            torch.save(state, tmp / STATE_FILE)

    def save(self, ckpt_dir: str, meta: dict) -> str:
        """Commit weights (HF format, loadable by vLLM), tokenizer, optimizer, LR schedule, RNGs and step at once."""
        full = {"optimizer_step": self.step, **meta}
        return str(checkpoint.commit(Path(ckpt_dir), lambda tmp: self.write_state(str(tmp), full), full))

    def load_state(self, ckpt_dir: str) -> dict:
        """Resume everything from a committed checkpoint: weights, optimizer, LR schedule, RNGs, step.
        Returns the checkpoint's meta (stage, step, global_step: the data position)."""
        meta = checkpoint.manifest(Path(ckpt_dir))  # refuses an uncommitted directory
        state = torch.load(Path(ckpt_dir) / STATE_FILE, weights_only=False)
        self.backend.load_state_dict(state["backend"], Path(ckpt_dir))
        _set_rng_state(torch.load(Path(ckpt_dir) / f"rng-rank{self.rank}.pt", weights_only=False))
        self.rng.setstate(state["trainer_rng"])
        self.step = state["step"]
        return meta


class LogprobGapError(ValueError):
    """The rollout engines' log-probs of the sampled tokens are too far from the trainer's (trainer.max_logprob_gap)."""


def check_logprob_gap(metrics: dict, cap: float | None) -> None:
    """Stop a step whose rollout was not sampled from the trainer's policy: `logprob_gap`, the mean over the batch's
    loss tokens of |log π_old(token) - log π_engine(token)|, above `cap`. The usual causes: engines that missed a
    weight sync (they sample from an older policy), another dtype, or token ids shifted against the log-probs."""
    gap = metrics.get("logprob_gap")
    if cap is not None and gap is not None and not gap <= cap:
        raise LogprobGapError(
            f"the rollout engines' log-probs of the sampled tokens differ from the trainer's by {gap:.4g} on average "
            f"(trainer.max_logprob_gap {cap:g}): the engines did not sample from the weights the trainer has (a "
            "missed weight sync), or read the tokens another way (dtype, shifted ids). The step stops before its "
            "checkpoint; a retry resumes from the last committed one")


def load_policy(model_dir: str, device: torch.device, cfg: TrainerCfg):
    """The model to train, and its peft wrapper under LoRA (else None): an adapter directory resumes its adapter on its
    base; with trainer.lora a plain model gets a fresh adapter (drawn from torch's generator). The adapted layers'
    frozen weights are held in the compute dtype (rstar2.core.adapter)."""
    resumed = adapter.is_adapter(model_dir)
    if not resumed and cfg.lora is None:
        return load_model(model_dir, device, cfg), None
    base = adapter.base_of(model_dir) if resumed else model_dir
    model = load_model(base, device, cfg)
    frozen = getattr(torch, cfg.dtype) if cfg.dtype in ("float32", "bfloat16") else torch.float32
    adapted = adapter.resume(model, model_dir, frozen) if resumed else adapter.attach(model, cfg.lora, base, frozen)
    return model, adapted.to(device)


def load_model(model_dir: str, device: torch.device, cfg: TrainerCfg | None = None):
    from transformers import AutoModelForCausalLM

    # fp32 master weights; bf16 is autocast (torch backend) or DeepSpeed's own mixed precision
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").to(device)
    # recompute each layer's activations in backward: memory for ~1/3 more compute
    if cfg and cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    use_varlen_attention(model)  # packed rows' segments; plain SDPA otherwise (fp32 under bf16 on a CPU)
    return model


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _set_rng_state(s: dict) -> None:
    torch.set_rng_state(s["torch"])
    np.random.set_state(s["numpy"])
    random.setstate(s["python"])
    if s.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


class _Batch:
    """The kept rollouts as the trainer needs them. Per-token side inputs are flat over all sequences (Σ L,),
    addressed by offsets[seq] + position."""

    def __init__(self, ids, mask, adv, engine, prompt_lens, groups):
        self.ids, self.mask = ids, mask                                          # lists of (L_i,) lists
        self.prompt_lens, self.groups = prompt_lens, groups                      # (n,) lists: prompt length, prompt id
        self.lengths = torch.tensor([len(s) for s in ids])                       # (n,)
        self.n_loss = torch.tensor([sum(m[1:]) for m in mask])                   # (n,) tokens that get gradient
        self.offsets = torch.cumsum(self.lengths, 0) - self.lengths              # (n,)
        self.mask_flat = torch.tensor([t for m in mask for t in m])              # (Σ L,)
        self.adv = adv                                                           # (n,)
        self.engine = engine                                                     # (Σ L,) or None
        self.old: torch.Tensor | None = None                                     # (Σ L,) when recomputed

    @classmethod
    def from_frame(cls, df: pl.DataFrame, c: TrainerCfg) -> "_Batch":
        has_engine = "response_logprobs" in df.columns  # read whenever recorded: logprob_gap is measured from them
        if (c.old_logprobs == "engine" or c.tis_cap is not None) and not has_engine:
            raise ValueError("trainer.old_logprobs=engine / trainer.tis_cap need the rollout engine's log-probs "
                             "(column response_logprobs); this batch has none")
        gid = torch.as_tensor(df["problem_id"].cast(pl.Utf8).cast(pl.Categorical).to_physical().to_list())
        adv = grpo.group_advantages(torch.as_tensor(df["reward"].to_list(), dtype=torch.float32), gid)   # (n,)
        ids, mask, eng, plen = [], [], [], []
        cols = ["prompt_ids", "response_ids", "loss_mask", "truncated"] + (["response_logprobs"] if has_engine else [])
        for prompt, resp, lm, trunc, *lp in df.select(cols).rows():
            plen.append(len(prompt))
            keep = 0 if (trunc and c.overlong_filter) else 1  # DAPO overlong filter (ablation; paper keeps them)
            ids.append(list(prompt) + list(resp))
            mask.append([0] * len(prompt) + [int(m) * keep for m in lm])
            if has_engine:
                eng += [0.0] * len(prompt) + list(lp[0])
        return cls(ids, mask, adv, torch.tensor(eng, dtype=torch.float32) if has_engine else None, plen,
                   df["problem_id"].cast(pl.Utf8).to_list())


class _Stats:
    """Token-weighted running metrics of one update (per-token stats are means over this rank's loss tokens)."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.loss, self.tokens, self.fed, self.real, self.grad_norm = 0.0, 0, 0, 0, 0.0

    def add(self, loss, st: dict, n_mb: int, n_tok: int, counts: bool) -> None:
        if not counts:
            return
        self.loss += float(loss.detach())
        self.tokens += n_mb
        for k, v in st.items():
            self.sums[k] = self.sums.get(k, 0.0) + float(v) * n_mb

    def metrics(self, n_minis: int, wall: float, lr: float, adv_abs: float, peak_mb: float) -> dict:
        t = max(1, self.tokens)
        return {"loss": self.loss / max(1, n_minis), **{k: v / t for k, v in self.sums.items()},
                "grad_norm": self.grad_norm, "lr": lr, "advantage_abs_mean": adv_abs,
                "update_tokens": self.real, "update_loss_tokens": self.tokens, "update_fed_tokens": self.fed,
                "fed_per_token": self.fed / max(1, self.real), "update_s": wall,
                "update_tokens_per_s": self.real / wall, "update_loss_tokens_per_s": self.tokens / wall,
                "update_peak_mem_mb": peak_mb}
