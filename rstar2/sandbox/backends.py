"""`connect(cfg)`: the sandbox backend the config names, all with the same interface (`submit`, `run_batch`,
`snapshot`, `isolation`, `close`), all running calls through the same SandboxService code:

- "local": the service in this process (the default; the rollout and the reward checks share it);
- "http": the batching client against `rstar2 sandbox serve` servers (`cfg.urls`);
- "ray": the batching client against a Ray actor group of services (`cfg.ray_actors` actors);
- "docker": the batching client against a service container this process starts (`cfg.docker_image`).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Protocol

from rstar2.sandbox.api import ExecRequest, ExecResult, SandboxLimits


class Backend(Protocol):
    def submit(self, req: ExecRequest) -> Future:
        """One call; the future resolves to its ExecResult (the rollout's tool calls)."""

    def run_batch(self, reqs: list[ExecRequest]) -> list[ExecResult]: ...

    def snapshot(self) -> dict: ...

    def isolation(self) -> dict: ...

    def close(self) -> None: ...


def limits_of(cfg) -> SandboxLimits:
    return SandboxLimits(timeout_s=cfg.timeout_s, memory_mb=cfg.memory_mb, cpu_s=cfg.cpu_s,
                         max_processes=cfg.max_processes, max_file_mb=cfg.max_file_mb,
                         max_output_chars=cfg.max_output_chars, tmpfs_mb=cfg.tmpfs_mb)


def connect(cfg) -> Backend:
    """`cfg` is a `rstar2.core.config.SandboxCfg`."""
    from rstar2.sandbox.client import BatchingClient, HttpTransport, SyncSandbox

    batching = dict(batch_size=cfg.batch_size, senders=cfg.senders, retries=cfg.retries)
    if cfg.backend == "local":
        from rstar2.sandbox.service import SandboxService

        return SandboxService(limits_of(cfg), slots=cfg.workers, queue_size=cfg.queue_size, require=cfg.require)
    if cfg.backend == "http":
        if not cfg.urls:
            raise ValueError("sandbox.backend=http needs sandbox.urls (e.g. [http://127.0.0.1:8000])")
        return SyncSandbox(BatchingClient(HttpTransport(cfg.urls), **batching))
    if cfg.backend == "ray":
        from rstar2.sandbox import ray_group

        actors = ray_group.start_group(cfg.ray_actors, limits_of(cfg), cfg.workers, cfg.queue_size, cfg.require)
        return SyncSandbox(BatchingClient(ray_group.RayTransport(actors), **batching),
                           on_close=lambda: ray_group.stop_group(actors))
    if cfg.backend == "docker":
        from rstar2.sandbox.docker_backend import docker_sandbox

        return docker_sandbox(cfg.docker_image, limits_of(cfg), cfg.workers, **batching)
    raise ValueError(f"unknown sandbox backend {cfg.backend!r}")
