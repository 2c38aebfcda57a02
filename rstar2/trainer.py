"""The policy trainer (plain torch; one CPU or one GPU). Wrapped as a Ray actor by rstar2.cluster.

One RL step = GRPO advantages over the RoC-kept rollouts, then `mini_batches` optimizer steps (paper: 1, strictly
on-policy) of the clipped token-mean loss (rstar2/grpo.py), each accumulated over token-budgeted micro-batches so no
compute goes to padding beyond a micro-batch's own longest sequence.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import polars as pl
import torch
from transformers import AutoModelForCausalLM

from rstar2 import checkpoint, device as dev, grpo
from rstar2.batching import next_token_logprobs, pad_right, token_budget_batches
from rstar2.config import TrainerCfg
from rstar2.world.tokenizer import load as load_tokenizer


class PolicyTrainer:
    def __init__(self, model_dir: str, cfg: TrainerCfg, seed: int = 0, threads: int | None = None):
        if threads:
            torch.set_num_threads(threads)
        torch.manual_seed(seed)
        self.cfg, self.seed = cfg, seed
        self.device = dev.pick(cfg.device)
        self.tokenizer = load_tokenizer(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(self.device)
        self.rng = random.Random(seed)
        self.step = 0  # optimizer steps taken
        self._new_optimizer()

    def _new_optimizer(self) -> None:
        c = self.cfg
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=c.lr, weight_decay=c.weight_decay)
        # constant lr after a linear warm-up (paper: 1e-6, 20 steps)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(1.0, (s + 1) / max(1, c.warmup_steps)))

    def reset_optimizer(self) -> None:
        """Fresh AdamW state and warm-up, as the recipe does between stages."""
        self._new_optimizer()

    def _rows(self, df: pl.DataFrame) -> list[tuple[list[int], list[int]]]:
        seqs = []
        for prompt, resp, mask, trunc in df.select("prompt_ids", "response_ids", "loss_mask", "truncated").rows():
            keep = 0 if (trunc and self.cfg.overlong_filter) else 1
            seqs.append((list(prompt) + list(resp), [0] * len(prompt) + [m * keep for m in mask]))
        return seqs

    def _logprobs(self, ids: list[list[int]], grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        x = pad_right(ids, self.tokenizer.pad_token_id).to(self.device)  # (B, T)
        attn = pad_right([[1] * len(s) for s in ids], 0).to(self.device)  # (B, T)
        with torch.set_grad_enabled(grad), dev.autocast(self.device, self.cfg.dtype):
            return next_token_logprobs(self.model, x, attn), attn  # (B, T-1)

    def update(self, batch_parquet: str) -> dict:
        """One RL step on the kept rollouts (columns: problem_id, reward, prompt_ids, response_ids, loss_mask,
        truncated). Returns scalar metrics."""
        t0 = time.perf_counter()
        df = pl.read_parquet(batch_parquet)
        if df.height == 0:
            return {"skipped": 1.0, "update_s": 0.0, "update_tokens": 0}  # every group was all-equal: no signal
        c = self.cfg
        gid = torch.as_tensor(df["problem_id"].cast(pl.Categorical).to_physical().to_list())
        adv = grpo.group_advantages(torch.as_tensor(df["reward"].to_list(), dtype=torch.float32), gid)  # (N,)
        seqs = self._rows(df)
        lengths = [len(s) for s, _ in seqs]
        order = list(range(len(seqs)))
        self.rng.shuffle(order)
        minis = [order[i:: c.mini_batches] for i in range(c.mini_batches)]
        old: dict[int, torch.Tensor] = {}
        if c.mini_batches > 1:  # later mini-batches need the behaviour policy's log-probs, fixed before any update
            for mb in token_budget_batches(lengths, c.micro_batch_tokens):
                lp, _ = self._logprobs([seqs[i][0] for i in mb], grad=False)
                old.update({i: lp[r, : lengths[i] - 1] for r, i in enumerate(mb)})
        self.model.train()
        stats: dict[str, float] = {}
        tokens = 0
        for mini in minis:
            n_tok = sum(sum(seqs[i][1][1:]) for i in mini)  # Eq. 6 normaliser: all loss tokens of the mini-batch
            self.opt.zero_grad(set_to_none=True)
            for mb in token_budget_batches([lengths[i] for i in mini], c.micro_batch_tokens):
                idx = [mini[j] for j in mb]
                logp, attn = self._logprobs([seqs[i][0] for i in idx], grad=True)  # (B, T-1)
                mask = pad_right([seqs[i][1][1:] for i in idx], 0).to(logp.device).float()  # (B, T-1)
                old_lp = (pad_right([old[i].tolist() for i in idx], 0.0, torch.float32).to(logp.device)
                          if old else logp.detach())
                loss, st = grpo.policy_loss(logp, old_lp, adv[idx].to(logp.device), mask, c.eps_low, c.eps_high,
                                            c.dual_clip, num_tokens=max(1, n_tok))
                loss.backward()
                tokens += int(attn.sum())
                for k, v in {"loss": loss, **st}.items():
                    stats[k] = stats.get(k, 0.0) + float(v.detach()) * (float(mask.sum()) / max(1, n_tok) if k != "loss" else 1)
            gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.grad_clip)
            self.opt.step()
            self.sched.step()
            self.step += 1
            stats["grad_norm"] = float(gn)
        wall = time.perf_counter() - t0
        return {**{k: v / len(minis) if k not in ("grad_norm",) else v for k, v in stats.items()},
                "lr": self.sched.get_last_lr()[0], "update_tokens": tokens, "update_s": wall,
                "update_tokens_per_s": tokens / wall, "advantage_abs_mean": float(adv.abs().mean())}

    def save(self, ckpt_dir: str, meta: dict) -> str:
        """Commit model + tokenizer (HF format, loadable by vLLM) and the optimizer/LR/RNG state, atomically."""
        def write(tmp: Path) -> None:
            self.model.save_pretrained(str(tmp), safe_serialization=True)
            self.tokenizer.save_pretrained(str(tmp))
            torch.save({"optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict(),
                        "torch_rng": torch.get_rng_state(), "py_rng": self.rng.getstate(), "step": self.step},
                       tmp / "trainer_state.pt")
            (tmp / "trainer_meta.json").write_text(json.dumps({"optimizer_step": self.step, **meta}))
        return str(checkpoint.commit(Path(ckpt_dir), write, {"optimizer_step": self.step, **meta}))

    def load_state(self, ckpt_dir: str) -> None:
        """Resume optimizer, LR schedule and RNG state from a committed checkpoint (weights come with __init__)."""
        state = torch.load(Path(ckpt_dir) / "trainer_state.pt", weights_only=False)
        self.opt.load_state_dict(state["optimizer"])
        self.sched.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        self.rng.setstate(state["py_rng"])
        self.step = state["step"]
