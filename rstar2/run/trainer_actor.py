"""A run's trainer actor (rstar2.training.trainer.PolicyTrainer, or a TrainerGroup fronting one DeepSpeed rank per
GPU): its updates, checkpoints, restores and optimizer resets, and where its live state can be had again.

A trainer that dies (its process killed, its node lost; with trainer.world_size > 1 any of its ranks, and then the
whole group) is started again in the state it had before: the last checkpoint it saved or was restored from, or the
model it started from, with any optimizer reset since; an update it was in is redone (the same batch from the same
state gives the same step). With placement.colocate the engines sleep during each update, so the trainer ranks on
the same GPUs have them.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable

import ray
from ray.exceptions import RayActorError

from rstar2.core.config import RunCfg
from rstar2.rollout import placement
from rstar2.run.actors import actor_names, await_released, find, kill, on_gpus
from rstar2.run.engine_actors import EngineActors
from rstar2.training.trainer import PolicyTrainer, check_logprob_gap
from rstar2.training.trainer_group import RankDied, TrainerGroup

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TrainerState:
    """Where the trainer's live state can be had again: its weights' directory, whether that is a committed checkpoint
    (optimizer, LR schedule and RNGs too) or a model to start fresh from, and whether the optimizer was reset since."""
    source: str
    committed: bool = False
    optimizer_reset: bool = False


class TrainerActor:
    """The trainer of run `run_id`: `handle` (None until launched), `respawned` (trainers started again after they
    died, over the run), `colocated` (the engines that sleep around each update, placement.colocate)."""

    def __init__(self, run_id: str):
        self.name = actor_names(run_id, 0)[1]
        self.handle = None
        self.respawned = 0
        self.colocated: EngineActors | None = None
        self.max_logprob_gap: float | None = None  # trainer.max_logprob_gap, checked after each update
        self._cfg: RunCfg | None = None  # what a lost trainer is started again with
        self._placement: placement.Placement | None = None
        self._state: TrainerState | None = None
        self._updated_on: str | None = None  # the batch of its update since its state was last saved

    def configure(self, cfg: RunCfg, place: placement.Placement) -> None:
        self._cfg, self._placement = cfg, place
        self.max_logprob_gap = cfg.trainer.max_logprob_gap

    def launch(self, model_dir: str) -> Callable[[], None]:
        """Start the trainer from `model_dir` unless it is running (one alive under its name is taken over); returns
        what waits until it is up."""
        if self.handle is not None:
            return lambda: None
        self.handle = find(self.name) or _spawn(self.name, self._cfg, model_dir, self._placement)
        up = self.handle.__ray_ready__.remote()
        self._state, self._updated_on = TrainerState(model_dir), None
        return lambda: ray.get(up)

    def stop(self, timeout_s: float | None = None) -> None:
        """Kill it; with `timeout_s`, wait until its name is free for a new one."""
        kill(self.handle)
        self.handle = None
        if timeout_s is not None:
            await_released(self.name, timeout_s)

    def update(self, batch_uri: str, staleness: int = 0) -> dict:
        """One GRPO-RoC update on the kept batch; the trainer's step metrics. `staleness`: updates between the weights
        that sampled the batch and the trainer's (rollout.max_staleness); the log-prob gap is a check of the weight
        sync only on a batch of the trainer's own weights (0), on an older one it measures the lag. A trainer that
        dies is started again in its state before the update, and the update is redone (bit-identical)."""
        try:
            metrics = self._update(batch_uri)
        except (RayActorError, RankDied) as e:
            self._respawn(e)
            metrics = self._update(batch_uri)
        self._updated_on = batch_uri
        if not staleness:
            check_logprob_gap(metrics, self.max_logprob_gap)
        return metrics

    def _update(self, batch_uri: str) -> dict:
        if self.colocated is None:
            return ray.get(self.handle.update.remote(batch_uri))
        self.colocated.sleep()
        try:
            return ray.get(self.handle.update.remote(batch_uri))
        finally:
            self.colocated.wake_up()

    def _respawn(self, died: Exception, timeout_s: float = 60.0) -> None:
        """The trainer again, as it was after its last start, save or restore (and optimizer reset since)."""
        was = self._state
        log.warning("trainer died (%s); starting it again from %s", type(died).__name__, was.source)
        kill(self.handle)
        await_released(self.name, timeout_s)
        self.handle = _spawn(self.name, self._cfg, was.source, self._placement)
        if was.committed:
            self.restore(was.source)
        if was.optimizer_reset:
            self.reset_optimizer()
        self.respawned += 1

    def save(self, ckpt_dir: str, meta: dict) -> str:
        """Commit the trainer's state (weights, optimizer, LR schedule, RNG) as a checkpoint; its path."""
        try:
            path = ray.get(self.handle.save.remote(ckpt_dir, meta))
        except (RayActorError, RankDied) as e:  # died after its update: started again, it redoes it, then saves
            batch = self._updated_on
            self._respawn(e)
            if batch is not None:
                self._update(batch)
            path = ray.get(self.handle.save.remote(ckpt_dir, meta))
        self._state, self._updated_on = TrainerState(path, committed=True), None
        return path

    def restore(self, ckpt_dir: str) -> None:
        """A resumed run: the trainer (started from the checkpoint's weights) takes back its optimizer/LR/RNG state."""
        ray.get(self.handle.load_state.remote(ckpt_dir))
        self._state, self._updated_on = TrainerState(ckpt_dir, committed=True), None

    def reset_optimizer(self) -> None:
        ray.get(self.handle.reset_optimizer.remote())
        self._state = dataclasses.replace(self._state, optimizer_reset=True)


def _spawn(name: str, cfg: RunCfg, model_dir: str, place: placement.Placement):
    args = (model_dir, cfg.trainer, cfg.rl_seed, os.cpu_count())
    if cfg.trainer.world_size == 1:
        return ray.remote(PolicyTrainer).options(name=name, **place.rank_options(0)).remote(*args)
    # a coordinator actor (no GPU, outside the groups) fronting one DeepSpeed rank actor per trainer bundle
    ranks = [place.rank_options(r) for r in range(cfg.trainer.world_size)]
    return ray.remote(num_cpus=0, num_gpus=0)(TrainerGroup).options(name=name).remote(
        *args, gpus_per_rank=1.0 if on_gpus(cfg) else 0.0, rank_options=ranks)  # CPU ranks split the cores
