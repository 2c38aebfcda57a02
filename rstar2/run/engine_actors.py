"""A run's vLLM engine actors (rstar2.rollout.engine_actor.EngineActor): started from a model, or taken over alive under
their names, each in its placement; their KV capacity as vLLM sized it; the agent loop's clients of them; a call on
every engine at once; a reload from a checkpoint directory; the check that they serve the weights they were sent
(rstar2.core.fingerprint); sleep and wake-up around a colocated trainer's update.

An engine found dead by a call on every engine is started again under its name and in its placement, from the
weights being loaded: a lost engine never ends a run (the rollout has already moved its trajectories to the others).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import ray
from ray.exceptions import RayActorError

from rstar2.core import adapter, fingerprint
from rstar2.core.config import RunCfg
from rstar2.core.fingerprint import WeightSyncError
from rstar2.rollout import cluster, placement
from rstar2.rollout.agent_loop import EngineSet
from rstar2.rollout.cluster import EngineClient
from rstar2.rollout.engine_actor import EngineActor
from rstar2.rollout.vllm_backend import EngineSpec
from rstar2.run.actors import actor_names, await_released, find, kill

log = logging.getLogger(__name__)


class EngineActors:
    """The engines of run `run_id`: `handles` by index, `info` (each one's KV capacity, block size and dtype, as vLLM
    sized them), `loaded` (the weights every engine holds now), `respawned` (engines started again after they died,
    over the run)."""

    def __init__(self, run_id: str):
        self.run_id = run_id
        self.handles: list = []
        self.info: list[dict] = []
        self.loaded: str | None = None
        self.respawned = 0
        self.fingerprints_comparable = True  # the engines' weight fingerprints match their checkpoints' (at start)
        self._cfg: RunCfg | None = None  # what a lost engine is started again with
        self._placement: placement.Placement | None = None

    def launch(self, cfg: RunCfg, model_dir: str, place: placement.Placement) -> Callable[[], None]:
        """Start the engines from `model_dir` unless they are running (those alive under their names are taken
        over); returns what waits until they are up, to call once the trainer is under way too."""
        self._cfg, self._placement = cfg, place
        if self.handles:
            return lambda: None
        names = actor_names(self.run_id, cfg.engine.num_engines)[0]
        live = [find(n) for n in names]
        fresh = not any(live)  # engines started here from model_dir (none taken over)
        self.handles = [e or _spawn(n, cfg, model_dir, i, place) for i, (n, e) in enumerate(zip(names, live))]
        up = [e.info.remote() for e in self.handles]

        def ready() -> None:
            self.info = ray.get(up)
            self.loaded = model_dir
            if fresh:
                self.calibrate_fingerprint(model_dir)
        return ready

    def stop(self) -> None:
        for handle in self.handles:
            kill(handle)
        self.handles, self.info, self.loaded = [], [], None

    def clients(self, temperature: float, top_p: float, logprobs: bool = False) -> EngineSet:
        """A client per engine (the agent loop submits turns through them) and each engine's KV capacity in tokens
        (num_gpu_blocks x block_size)."""
        caps = [int(i["kv_capacity_tokens"]) for i in self.info]
        return EngineSet([EngineClient(e, temperature, top_p, int(i["block_size"] or 1), logprobs)
                          for e, i in zip(self.handles, self.info)], caps)

    def load(self, model_dir: str) -> str:
        """Every engine reloads `model_dir` in place (vLLM keeps its KV cache and compiled graphs); nothing to do
        when they already hold it (committed checkpoints never change)."""
        if model_dir != self.loaded:
            self.on_every(lambda e: e.load_weights.remote(model_dir), model_dir)
            self.took(model_dir)
        return model_dir

    def took(self, model_dir: str) -> None:
        """Every engine has just loaded `model_dir`'s weights: checked, they are what the engines hold now."""
        self.check_weights(model_dir)
        self.loaded = model_dir

    def on_every(self, call, model_dir: str) -> None:
        """`call(engine)` on every engine at once; one found dead (its process killed, its node lost) is started
        again under its name and in its placement from `model_dir`, which it loads as it starts."""
        refs = [call(e) for e in self.handles]
        for i, ref in enumerate(refs):
            try:
                ray.get(ref)
            except RayActorError as e:
                log.warning("engine %d died (%s); starting it again from %s", i, type(e).__name__, model_dir)
                self._respawn(i, model_dir)

    def _respawn(self, i: int, model_dir: str, timeout_s: float = 60.0) -> None:
        name = actor_names(self.run_id, len(self.handles))[0][i]
        kill(self.handles[i])
        await_released(name, timeout_s)
        self.handles[i] = _spawn(name, self._cfg, model_dir, i, self._placement)
        self.info[i] = ray.get(self.handles[i].info.remote())
        self.respawned += 1

    def sleep(self) -> None:
        """Colocated: weights to CPU memory and KV cache dropped, so the trainer has the GPUs."""
        ray.get([e.sleep.remote() for e in self.handles])

    def wake_up(self) -> None:
        ray.get([e.wake_up.remote() for e in self.handles])

    def calibrate_fingerprint(self, model_dir: str) -> None:
        """Engines just started from `model_dir` hold exactly its weights: where their fingerprint differs from the
        directory's all the same, this model family's loader transforms the tensors fingerprinted (a norm stored as
        1 + w, say), so the check is off for the run (one line says so) and the log-prob gap alone stands guard."""
        try:
            self.check_weights(model_dir)
        except WeightSyncError as e:
            self.fingerprints_comparable = False
            log.warning("weight fingerprints are not comparable for this model, so not checked (%s)", e)

    def check_weights(self, model_dir: str) -> None:
        """Each engine's weights, read back from its model, against `model_dir`'s (rstar2.core.fingerprint):
        WeightSyncError naming the engines that serve anything else. A directory without safetensors has nothing
        to compare against."""
        if not self.fingerprints_comparable:
            return
        served = ray.get([e.fingerprint.remote() for e in self.handles])  # [(dtype, fingerprint)]
        want = {dtype: fingerprint.of_checkpoint(model_dir, dtype) for dtype in {d for d, _ in served}}
        if adapter.is_adapter(model_dir) and not all(adapter.comparable(want[d], fp) for d, fp in served if fp):
            # vLLM named this model family's layers otherwise (a weights mapper): values cannot be matched by name
            self.fingerprints_comparable = False
            log.warning("adapter fingerprints are not comparable for this model (%s against %s), so not checked",
                        served, want)
            return
        wrong = [f"engine {i} {fp}" for i, (dtype, fp) in enumerate(served) if want[dtype] not in (None, fp)]
        if wrong:
            raise WeightSyncError(f"after loading {model_dir}: {', '.join(wrong)} against the checkpoint's "
                                  f"{', '.join(f'{v} ({k})' for k, v in want.items())}; the weights did not reach "
                                  "them (rstar2.core.fingerprint)")


def _spawn(name: str, cfg: RunCfg, model_dir: str, index: int, place: placement.Placement):
    # the engine's own seed is the world's: engines serve evaluation and every RL seed, and each trajectory-turn
    # carries its own sampling seed (rstar2.rollout.trajectory.Trajectory.turn_seed), so this one picks no sample
    spec = EngineSpec.of_run(cfg, model_dir, seed=cfg.seed + index)
    # num_cpus=0: on a 2-core laptop engines and trainer take turns, they never run at once. An async actor: its
    # event loop holds every waiting turn while the engine's own thread generates (rstar2.rollout.engine_actor)
    return ray.remote(EngineActor).options(name=name, max_concurrency=cluster.MAX_CONCURRENT_CALLS,
                                           **place.engine_options(index)).remote(spec)
