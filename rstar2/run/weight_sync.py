"""How a new checkpoint's weights reach a run's engines from its trainer (trainer.weight_sync):

- disk: every engine reads them back from the checkpoint directory (engines and trainer must share a filesystem);
- memory: rank 0's gathered state dict goes once into Ray's object store and each engine's reload reads it from there
  (zero-copy on the trainer's node; on GPUs it stages through host memory);
- collective: rank 0 sends them in buckets over a bus of its own with every engine worker (rstar2.core.weight_bus:
  NCCL on GPUs; on CPUs shared memory when all share its node, else gloo), each engine loading a bucket as it
  arrives. The bus is kept while its members live; a sync that fails all the same goes through the object store.

No file is read on the memory and collective paths. Every path ends with the engines' weights checked against the
checkpoint's (rstar2.run.engine_actors: fingerprints).

Under LoRA (trainer.lora) only the adapter travels, megabytes: from the checkpoint (disk), or as the trainer's adapter
through the object store (memory, and collective too: a bus buys nothing for so little), and each engine serves its
base with the new adapter (rstar2.rollout.vllm_backend); the check is the adapter's fingerprint. `last` holds every
sync's `sync_bytes` (the weights or adapter moved to each engine) beside `sync_model_bytes` (the whole model's).
"""

from __future__ import annotations

import logging
from pathlib import Path

import ray
from ray.exceptions import RayActorError

from rstar2.core import adapter, weight_bus
from rstar2.core.config import RunCfg
from rstar2.run.actors import alive, on_gpus
from rstar2.run.engine_actors import EngineActors
from rstar2.run.trainer_actor import TrainerActor
from rstar2.training.trainer_group import RankDied

log = logging.getLogger(__name__)


class WeightSync:
    """The trainer's weights to the engines, by `mode` (trainer.weight_sync); `last`: the last sync's figures (a
    collective one's, rstar2.core.weight_bus.send); `bus`: the open bus of the collective mode, if any."""

    def __init__(self, engines: EngineActors, trainer: TrainerActor):
        self.engines, self.trainer = engines, trainer
        self.mode = "disk"
        self.last: dict = {}
        self.bus: weight_bus.Bus | None = None
        self._members: tuple = ()  # the actors the bus was opened for
        self._key = 0  # the next sync's key on the bus
        self._cfg: RunCfg | None = None

    def configure(self, cfg: RunCfg) -> None:
        self._cfg, self.mode = cfg, cfg.trainer.weight_sync

    def trained(self, ckpt_dir: str) -> str:
        """After the trainer saved `ckpt_dir`: every engine takes its new weights; `ckpt_dir`."""
        self.last = {"sync_bytes": weights_bytes(ckpt_dir), "sync_model_bytes": self._model_bytes(ckpt_dir)}
        if self.mode == "disk":
            return self.engines.load(ckpt_dir)
        if self.mode == "collective" and not adapter.is_adapter(ckpt_dir):
            self._broadcast(ckpt_dir)
        else:
            self._send_by_object_store(ckpt_dir)
        self.engines.took(ckpt_dir)
        return ckpt_dir

    def _model_bytes(self, ckpt_dir: str) -> int:
        """The whole model's weights as saved (an adapter's base's)."""
        return weights_bytes(adapter.base_of(ckpt_dir)) if adapter.is_adapter(ckpt_dir) else weights_bytes(ckpt_dir)

    def _send_by_object_store(self, ckpt_dir: str) -> None:
        weights = self.trainer.handle.full_state_dict.remote()
        self.engines.on_every(lambda e: e.load_weights.remote(weights, ckpt_dir), ckpt_dir)

    def _broadcast(self, ckpt_dir: str) -> None:
        """One collective sync. Engines found dead start again from `ckpt_dir` first (a bus waits for all its
        members). A bus is opened for the actors alive then (its store on the trainer's node) and kept while they
        live. When a sync fails all the same (an engine died mid-sync, a peer timed out), the bus is dropped, and the
        engines take the weights through the object store (a dead one starts again): the step goes on, and the next
        sync opens a new bus. A dead trainer is the update's to recover from: its error goes up."""
        self.engines.on_every(lambda e: e.__ray_ready__.remote(), ckpt_dir)
        members = (*self.engines.handles, self.trainer.handle)
        if self.bus is None or len(members) != len(self._members) or \
                any(a is not b for a, b in zip(members, self._members)):
            self.bus, self._members, self._key = self._open_bus(), members, 0
        bus, key, tp = self.bus, self._key, self._cfg.engine.tensor_parallel_size
        self._key += 1
        loads = [e.load_weights.remote(weight_bus.Incoming(bus, key, 1 + i * tp), ckpt_dir)
                 for i, e in enumerate(self.engines.handles)]
        sent = self.trainer.handle.broadcast_weights.remote(bus, key)
        try:
            self.last.update(ray.get(sent))
            ray.get(loads)
        except Exception as e:  # noqa: BLE001 - sorted here: the trainer's death goes up, the rest is recovered
            self.bus = None
            if isinstance(e, RankDied) or isinstance(e, RayActorError) and not alive(self.trainer.handle):
                raise
            log.warning("collective weight sync failed (%s: %s); sending %s through the object store this time",
                        type(e).__name__, e, ckpt_dir)
            ray.wait(loads, num_returns=len(loads), timeout=bus.timeout_s)  # the receivers' own errors, or timeouts
            self._send_by_object_store(ckpt_dir)

    def _open_bus(self) -> weight_bus.Bus:
        cfg = self._cfg
        host, port = ray.get(self.trainer.handle.weight_bus_address.remote())
        dtype = (self.engines.info[0] if self.engines.info else {}).get("dtype", cfg.engine.dtype)
        return weight_bus.Bus(host, port, size=1 + len(self.engines.handles) * cfg.engine.tensor_parallel_size,
                              backend="nccl" if on_gpus(cfg) else "gloo",
                              bucket_bytes=cfg.trainer.sync_bucket_mb * 2**20, dtype=dtype)


def weights_bytes(model_dir: str) -> int:
    """The bytes of a model directory's weights files (safetensors), or of an adapter directory's adapter."""
    if adapter.is_adapter(model_dir):
        return adapter.nbytes(model_dir)
    return sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
