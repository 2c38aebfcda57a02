"""The code-execution service: isolated, high-throughput Python for tool calls and answer verification.

Layers (each its own module): `api` (requests, results, limits), `zygote` (the executor program: a warm
interpreter forking one hardened child per call), `executor` (routing, runtime, cgroups, zygote handles), `service`
(queue with backpressure + dispatcher + slots: the in-process backend), `metrics` (Prometheus + per-step
summaries), `server` (HTTP), `client` (batching async client over HTTP or Ray), `ray_group`, `docker_backend`,
`backends` (`connect(cfg)`: one backend object for whichever way the config says).
"""

from rstar2.sandbox.api import (
                                ERROR,
                                KILLED,
                                MEMORY,
                                OK,
                                OUTPUT_TRUNCATED,
                                STATUSES,
                                TIMEOUT,
                                TRUNCATION_MARKER,
                                ExecRequest,
                                ExecResult,
                                QueueFull,
                                SandboxLimits,
                                SandboxUnavailable,
)

__all__ = ["ERROR", "KILLED", "MEMORY", "OK", "OUTPUT_TRUNCATED", "STATUSES", "TIMEOUT", "TRUNCATION_MARKER",
           "ExecRequest", "ExecResult", "QueueFull", "SandboxLimits", "SandboxUnavailable"]
