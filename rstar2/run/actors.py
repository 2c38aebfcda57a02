"""A run's named Ray actors: their names, finding one alive, killing one and waiting until Ray has released its name
(rstar2.run.engine_actors and rstar2.run.trainer_actor start, find and restart theirs through these).

Actors are named `<run_id>-engine-<i>` and `<run_id>-trainer` (so they are found in the Ray dashboard, and a second
driver on a shared cluster uses a run id of its own) and are non-detached: they die with the driver, or when killed.
"""

from __future__ import annotations

import time

import ray
from ray.exceptions import RayActorError

from rstar2.core.config import RunCfg
from rstar2.rollout import cluster


def actor_names(run_id: str, num_engines: int) -> tuple[list[str], str]:
    return [f"{run_id}-engine-{i}" for i in range(num_engines)], f"{run_id}-trainer"


def find(name: str):
    """The live actor registered under `name`, or None."""
    try:
        return ray.get_actor(name, namespace=cluster.NAMESPACE)
    except ValueError:
        return None


def await_released(name: str, timeout_s: float) -> None:
    """Until no live actor holds `name` (Ray releases a killed or dead actor's name asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while find(name) is not None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"actor {name} still registered {timeout_s:.0f} s after it was killed")
        time.sleep(0.2)


def kill(handle) -> None:
    if handle is not None:
        try:
            ray.kill(handle)
        except ValueError:  # already gone
            pass


def alive(handle, timeout_s: float = 30.0) -> bool:
    try:
        ray.get(handle.__ray_ready__.remote(), timeout=timeout_s)
        return True
    except RayActorError:
        return False


def on_gpus(cfg: RunCfg) -> bool:
    """Engines sized by GPU memory run on GPUs (and so does the trainer); sized in bytes, on CPUs."""
    return cfg.engine.gpu_memory_utilization is not None
