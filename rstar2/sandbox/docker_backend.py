"""Run the service in a Docker container (image: `infra/docker/Dockerfile.sandbox`) through the Docker SDK, and
talk to it over HTTP with the batching client.

The container needs what the executors do inside it: create namespaces, mount tmpfs/proc, make cgroups and load
Landlock/seccomp filters. Docker's default seccomp and AppArmor profiles forbid `unshare`/`mount`, hence
`privileged=True` (the code itself never runs privileged: each call drops to an unprivileged uid with
no_new_privs, seccomp and Landlock inside its own namespaces). Where that is not acceptable, run the service on the
host with `rstar2 sandbox serve` instead.
"""

from __future__ import annotations

import time
import urllib.request

from rstar2.sandbox.api import SandboxLimits, SandboxUnavailable

DEFAULT_IMAGE = "rstar2-sandbox:latest"
PORT = 8000


def container_spec(image: str, limits: SandboxLimits, slots: int, port: int = PORT) -> dict:
    """Keyword arguments for `docker.containers.run` (the service bound to a random localhost port)."""
    command = ["sandbox", "serve", "--host", "0.0.0.0", "--port", str(port), "--slots", str(slots),
               "--timeout-s", str(limits.timeout_s), "--memory-mb", str(limits.memory_mb)]
    return {"image": image, "command": command, "detach": True, "privileged": True, "auto_remove": False,
            "ports": {f"{port}/tcp": ("127.0.0.1", None)}, "labels": {"rstar2": "sandbox"},
            "mem_limit": f"{slots * (limits.memory_mb + 512) + 1024}m", "pids_limit": slots * (limits.max_processes + 32)}


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
        spec = container_spec(image, limits or SandboxLimits(), slots)
        self.container = self._docker.containers.run(**spec)
        try:
            self.url = self._wait(startup_timeout_s)
        except BaseException:
            self.close()
            raise

    def _wait(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.container.reload()
            if self.container.status == "exited":
                raise SandboxUnavailable("sandbox container exited: " +
                                         self.container.logs(tail=30).decode("utf-8", "replace"))
            bound = (self.container.ports or {}).get(f"{PORT}/tcp")
            if bound:
                url = f"http://127.0.0.1:{bound[0]['HostPort']}"
                try:
                    with urllib.request.urlopen(f"{url}/health", timeout=2):
                        return url
                except OSError:
                    pass
            time.sleep(0.5)
        raise SandboxUnavailable(f"sandbox container not healthy after {timeout_s:.0f} s")

    def close(self) -> None:
        try:
            self.container.remove(force=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
