"""Run the service in a Docker container (image: `infra/docker/Dockerfile.sandbox`) through the Docker SDK, and
talk to it over HTTP with the batching client. One warm container serves every call of the run (its executors are
started once, as the local backend's are), with the same limits, passed whole to `rstar2 sandbox serve --limits`.
The container shares the host's network and the service binds 127.0.0.1 on a free port: no bridge, no published
ports, nothing beyond localhost (the engine here runs with `--bridge=none`; see infra/dev.sh).

The container needs what the executors do inside it: create namespaces, mount tmpfs/proc, make cgroups and load
Landlock/seccomp filters. Docker's default seccomp and AppArmor profiles forbid `unshare`/`mount`, so the container
gets what `--privileged` would give, spelled out (`CONTAINMENT`): every capability but CAP_SYS_RESOURCE (which the
executors do not use, and which a machine that is itself a container may not hold to hand on: then `--privileged`
fails with "unable to apply caps"), no seccomp/AppArmor profile, and the cgroup tree writable for the
per-slot cgroups. The code itself never runs privileged: each call drops to an unprivileged uid with no_new_privs,
seccomp and Landlock inside its own namespaces. Where that is not acceptable, run the service on the host with
`rstar2 sandbox serve` instead.
"""

from __future__ import annotations

import dataclasses
import json
import time
import urllib.request

from rstar2.core.net import free_port
from rstar2.sandbox.api import SandboxLimits, SandboxUnavailable

DEFAULT_IMAGE = "rstar2-sandbox:latest"
CONTAINMENT = {"cap_add": ["ALL"], "cap_drop": ["SYS_RESOURCE"],
               "security_opt": ["seccomp=unconfined", "apparmor=unconfined"],
               "volumes": {"/sys/fs/cgroup": {"bind": "/sys/fs/cgroup", "mode": "rw"}}}


def container_spec(image: str, limits: SandboxLimits, slots: int, port: int) -> dict:
    """Keyword arguments for `docker.containers.run`: the service on 127.0.0.1:`port` of the host's network."""
    command = ["sandbox", "serve", "--host", "127.0.0.1", "--port", str(port), "--slots", str(slots),
               "--limits", json.dumps(dataclasses.asdict(limits))]
    return {"image": image, "command": command, "detach": True, **CONTAINMENT, "auto_remove": False,
            "network_mode": "host", "labels": {"rstar2": "sandbox"},
            "mem_limit": f"{slots * (limits.memory_mb + 512) + 1024}m",
            "pids_limit": slots * (limits.max_processes + 32)}


class DockerService:
    """Starts the container, waits until `/health` answers, and stops it on `close()`."""

    def __init__(self, image: str = DEFAULT_IMAGE, limits: SandboxLimits | None = None, slots: int = 4,
                 startup_timeout_s: float = 120.0):
        try:
            import docker

            self._docker = docker.from_env()
            self._docker.ping()
        except Exception as e:  # noqa: BLE001 - docker raises several kinds; one clear message
            raise SandboxUnavailable(f"sandbox backend 'docker' needs a reachable Docker engine: {e}") from e
        self.url = f"http://127.0.0.1:{(port := free_port())}"
        self.container = self._docker.containers.run(**container_spec(image, limits or SandboxLimits(), slots, port))
        try:
            self._wait(startup_timeout_s)
        except BaseException:
            self.close()
            raise

    def _wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.container.reload()
            if self.container.status == "exited":
                raise SandboxUnavailable("sandbox container exited: " +
                                         self.container.logs(tail=30).decode("utf-8", "replace"))
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.2)
        raise SandboxUnavailable(f"sandbox container not healthy after {timeout_s:.0f} s")

    def cpu_seconds(self) -> float:
        """CPU time of everything in the container (its cgroup's), the service and every executor together."""
        stats = self.container.stats(stream=False, one_shot=True)
        return stats["cpu_stats"]["cpu_usage"]["total_usage"] / 1e9

    def executor_pids(self) -> list[int]:
        """The executors' pids as the host sees them (the service's executor processes run zygote.py)."""
        top = self.container.top(ps_args="-eo pid,args")
        return [int(row[0]) for row in top["Processes"] if "zygote.py" in row[-1]]

    def close(self) -> None:
        try:
            self.container.remove(force=True)
        except Exception:  # noqa: BLE001 - already gone
            pass


def docker_sandbox(image: str, limits: SandboxLimits, slots: int, **batching):
    """The docker backend: a `SyncSandbox` on the container's service; `.service` is the `DockerService`, and
    closing the sandbox removes the container."""
    from rstar2.sandbox.client import BatchingClient, HttpTransport, SyncSandbox

    svc = DockerService(image, limits, slots)
    sandbox = SyncSandbox(BatchingClient(HttpTransport([svc.url]), **batching), on_close=svc.close)
    sandbox.service = svc
    return sandbox
