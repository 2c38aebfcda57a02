"""Data-parallel training as Ray actors: `TrainerGroup` fronts `world_size` PolicyTrainer ranks (one GPU each, or CPU
processes sharing the machine's cores when there is no GPU; DeepSpeed ZeRO-2/3) behind PolicyTrainer's own interface
(update, save, load_state, reset_optimizer), so the flow's tasks call one named actor whatever the backend. Every rank
reads the whole batch and trains on its token-balanced share (rstar2.training.batching.shard); checkpoints need a
filesystem every rank can write (one node, or shared storage)."""

from __future__ import annotations

from pathlib import Path

import ray
from ray.exceptions import RayActorError

from rstar2.core import checkpoint
from rstar2.core.config import TrainerCfg

SUMMED = ("loss", "update_tokens", "update_loss_tokens", "update_fed_tokens")
MAXED = ("update_s", "update_peak_mem_mb")
RANK0 = ("grad_norm", "lr", "advantage_abs_mean", "skipped")


class RankDied(RuntimeError):
    """A rank of the group died (its process killed, its node lost). The others cannot go on without it (every update
    ends in collectives over all ranks), so the controller starts the whole group again from its last state."""


class _Rank:
    """A GPU slot: reports where it runs (rank 0 hosts the process-group store), then hosts one PolicyTrainer."""

    def address(self) -> tuple[str, int]:
        from rstar2.core.net import free_port

        return ray.util.get_node_ip_address(), free_port("")

    def start(self, *args, **kwargs) -> None:
        from rstar2.training.trainer import PolicyTrainer

        self.trainer = PolicyTrainer(*args, **kwargs)

    def call(self, method: str, *args):
        return getattr(self.trainer, method)(*args)

    def attr(self, name: str):
        return getattr(self.trainer, name)


def merge_rank_metrics(per_rank: list[dict]) -> dict:
    """One step's metrics from every rank's: token counts summed, per-token stats weighted by loss tokens."""
    if len(per_rank) == 1:
        return per_rank[0]
    out = {k: per_rank[0][k] for k in RANK0 if k in per_rank[0]}
    out.update({k: sum(m.get(k, 0) for m in per_rank) for k in SUMMED if k in per_rank[0]})
    out.update({k: max(m.get(k, 0) for m in per_rank) for k in MAXED if k in per_rank[0]})
    w = [m.get("update_loss_tokens", 0) for m in per_rank]
    for k in per_rank[0]:
        if k not in out and not k.endswith(("_per_s", "fed_per_token")):
            out[k] = sum(m[k] * wi for m, wi in zip(per_rank, w)) / max(1, sum(w))
    if out.get("update_s"):
        out["update_tokens_per_s"] = out["update_tokens"] / out["update_s"]
        out["update_loss_tokens_per_s"] = out["update_loss_tokens"] / out["update_s"]
        out["fed_per_token"] = out["update_fed_tokens"] / max(1, out["update_tokens"])
    return out


class TrainerGroup:
    def __init__(self, model_dir: str, cfg: TrainerCfg, seed: int = 0, threads: int | None = None,
                 gpus_per_rank: float = 1.0, rank_options: list[dict] | None = None):
        # rank_options: each rank's Ray actor options (rstar2.rollout.placement: its placement-group bundle and GPU
        # share)
        slot = ray.remote(num_gpus=gpus_per_rank, num_cpus=0)(_Rank)
        self.ranks = [slot.options(**opts).remote() for opts in rank_options or [{}] * cfg.world_size]
        master = ray.get(self.ranks[0].address.remote())
        if threads and not gpus_per_rank:  # CPU ranks share the cores: one rank's threads each, not all of them
            threads = max(1, threads // cfg.world_size)
        ray.get([r.start.remote(model_dir, cfg, seed, threads, rank=i, world_size=cfg.world_size, master=master)
                 for i, r in enumerate(self.ranks)])

    def _all(self, method: str, *args) -> list:
        """`method` on every rank; the first failure at once, as RankDied when a rank is dead (the living ones may
        wait in a collective for it: read in rank order, the answers would hang behind them)."""
        refs = [r.call.remote(method, *args) for r in self.ranks]
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except Exception as e:  # noqa: BLE001 - sorted below: a dead rank, or this rank's own error
                if dead := self._dead_ranks(e, refs.index(done[0])):
                    raise RankDied(f"rank(s) {dead} of {len(self.ranks)} died during {method}: {e}") from e
                raise
        return ray.get(refs)

    def _dead_ranks(self, error: Exception, failed: int, timeout_s: float = 30.0) -> list[int]:
        """The ranks that are dead after `error` on rank `failed`: that rank when its actor died, else any rank that
        does not answer a ping as dead (one whose peer died mid-collective errors before Ray reports the death)."""
        if isinstance(error, RayActorError):
            return [failed]
        pings = [r.__ray_ready__.remote() for r in self.ranks]  # all at once: the living may each be stuck in a call
        answered, _ = ray.wait(pings, num_returns=len(pings), timeout=timeout_s)  # the rest: alive, inside a call
        dead = []
        for i, ping in enumerate(pings):
            try:
                if ping in answered:
                    ray.get(ping)
            except RayActorError:
                dead.append(i)
        return dead

    def update(self, batch_parquet: str) -> dict:
        return merge_rank_metrics(self._all("update", batch_parquet))

    def reset_optimizer(self) -> None:
        self._all("reset_optimizer")

    def save(self, ckpt_dir: str, meta: dict) -> str:
        full = {"optimizer_step": ray.get(self.ranks[0].attr.remote("step")), **meta}
        return str(checkpoint.commit(Path(ckpt_dir), lambda tmp: self._all("write_state", str(tmp), full), full))

    def full_state_dict(self) -> dict:
        """Rank 0's gathered weights (every rank takes part in the gather)."""
        return self._all("full_state_dict")[0]

    def weight_bus_address(self) -> tuple[str, int]:
        return ray.get(self.ranks[0].call.remote("weight_bus_address"))

    def broadcast_weights(self, bus, key: int) -> dict:
        """Rank 0 sends (rstar2.core.weight_bus); every rank takes part in gathering the weights."""
        return self._all("broadcast_weights", bus, key)[0]

    def load_state(self, ckpt_dir: str) -> dict:
        return self._all("load_state", ckpt_dir)[0]
