"""The service as a Ray actor group (clusters): each actor holds one SandboxService (its own executor slots on its
node); the batching client's senders spread batches over the actors, as over several HTTP servers."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import asdict

import ray

from rstar2.sandbox.api import ExecRequest, SandboxLimits
from rstar2.sandbox.client import TransientError
from rstar2.sandbox.metrics import merge


class SandboxActor:
    """Ray actor wrapping one service; threaded, so several batches run on its slots at once."""

    def __init__(self, limits: dict, slots: int, queue_size: int, require: list[str]):
        from rstar2.sandbox.service import SandboxService

        self.service = SandboxService(SandboxLimits(**limits), slots=slots, queue_size=queue_size, require=require)

    def run_batch(self, batch: list[dict]) -> list[dict]:
        return [r.to_dict() for r in self.service.run_batch([ExecRequest.from_dict(b) for b in batch])]

    def snapshot(self) -> dict:
        return self.service.snapshot()

    def isolation(self) -> dict:
        return self.service.isolation()

    def close(self) -> None:
        self.service.close()


def start_group(n: int, limits: SandboxLimits, slots: int, queue_size: int = 4096, require: list[str] = (),
                num_cpus: float = 0.0) -> list:
    """`n` actors, spread over the cluster's nodes (each needs root for the full isolation layers)."""
    cls = ray.remote(num_cpus=num_cpus, max_concurrency=64)(SandboxActor)
    actors = [cls.options(scheduling_strategy="SPREAD").remote(asdict(limits), slots, queue_size, list(require))
              for _ in range(n)]
    ray.get([a.isolation.remote() for a in actors])  # constructed (and probed) before use
    return actors


class RayTransport:
    def __init__(self, actors: list):
        if not actors:
            raise ValueError("RayTransport needs at least one actor")
        self.actors = actors
        self._next = itertools.cycle(range(len(actors)))

    async def send(self, batch: list[dict]) -> list[dict]:
        try:
            return await self.actors[next(self._next)].run_batch.remote(batch)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            raise TransientError(repr(e)) from e

    async def snapshot(self) -> dict:
        return merge(await asyncio.gather(*(a.snapshot.remote() for a in self.actors)))

    async def isolation(self) -> dict:
        return await self.actors[0].isolation.remote()

    async def close(self) -> None:
        pass


def stop_group(actors: list) -> None:
    ray.get([a.close.remote() for a in actors])
    for a in actors:
        ray.kill(a)
