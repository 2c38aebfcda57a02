"""The multi-rank DeepSpeed trainer on CPU (rstar2/training/deepspeed_backend.py): two rank actors under ZeRO-2 and
ZeRO-3 make the same updates as one plain-torch process on the same recorded batches (several micro-batches each), and a
save -> restore -> next update is bit-identical to never having stopped. The first run JIT-compiles DeepSpeed's shm comm
op (~1 min, cached). A rank killed makes the group's next call fail at once with RankDied (the controller then starts
the whole group again: tests/unit/test_controller.py)."""

import os
import time

import pytest
import ray
import torch

from rstar2.core import config
from rstar2.rollout import cluster
from rstar2.training.trainer import PolicyTrainer
from rstar2.training.trainer_group import RankDied, TrainerGroup
from rstar2.world import build
from tests.unit.test_trainer import TINY, batch

pytestmark = pytest.mark.e2e

REWARDS = [1, 0, 0, 1, 0, 1, 1, 1, 1, 0, 0, 0, 1, 1, 0, 0]
LR = 1e-3
# Tolerance on each parameter's change, as a fraction of the learning rate. The ranks sum the same per-token terms in
# another order (each rank its share, then gloo's reduction), so gradients agree to fp32 rounding (~1e-7 relative).
# Adam's first step is lr * g / (|g| + eps): a rounding difference moves it only where |g| is near eps, and then by a
# tiny fraction of lr. 1e-3 * lr is far below the step itself (~lr per weight), so a wrong share, a missing rank's
# gradient or a double count (each a change of order lr) fails it.
TOL = 1e-3 * LR


def cfg(**kw) -> config.TrainerCfg:
    return config.TrainerCfg(lr=LR, warmup_steps=1, micro_batch_tokens=64, **kw)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build.build(config.load("tiny", TINY), tmp_path_factory.mktemp("world"))["init_model"]


@pytest.fixture(scope="module")
def ray_up():
    cluster.init()
    yield


def group(model_dir, c):
    return TrainerGroup(str(model_dir), c, seed=0, threads=2, gpus_per_rank=0)


def stop(g: TrainerGroup) -> None:
    for r in g.ranks:
        ray.kill(r)


@pytest.mark.parametrize("stage", [2, 3])
def test_two_ranks_match_one_and_resume_bit_identical(tiny_model, ray_up, tmp_path, stage):
    b1 = batch(tmp_path / "b1.parquet", REWARDS, seed=1)
    b2 = batch(tmp_path / "b2.parquet", REWARDS, seed=2)
    ref = PolicyTrainer(tiny_model, cfg(), seed=0)
    w0 = ref.full_state_dict()
    ref.update(b1)
    want = ref.full_state_dict()
    ref.update(b2)
    want2 = ref.full_state_dict()  # the second step: catches gradients leaking from one step into the next

    ds = cfg(backend="deepspeed", zero_stage=stage, world_size=2)
    a = group(tiny_model, ds)
    a.update(b1)
    got = a.full_state_dict()
    assert got.keys() == want.keys()
    moved = max(float((want[k] - w0[k]).abs().max()) for k in want)
    assert moved > 0.5 * LR  # the update is real: Adam's first step moves weights by ~lr
    for k in want:
        assert torch.allclose(got[k], want[k], rtol=0, atol=TOL), k

    ckpt = a.save(str(tmp_path / "step-1"), {"step": 1})
    a.update(b2)
    uninterrupted = a.full_state_dict()
    stop(a)
    for k in want2:
        assert torch.allclose(uninterrupted[k], want2[k], rtol=0, atol=TOL), k

    b = group(ckpt, ds)  # a resumed run starts the ranks from the checkpoint's weights, then takes back the state
    assert b.load_state(ckpt)["step"] == 1
    b.update(b2)
    resumed = b.full_state_dict()
    if stage == 2:  # a rank killed: the group's next call fails at once, naming it, not waiting on its collectives
        ray.kill(b.ranks[1])
        t0 = time.monotonic()
        with pytest.raises(RankDied, match=r"rank\(s\) \[1\] of 2 died during update"):
            b.update(b2)
        assert time.monotonic() - t0 < 60
        # seen first from a living rank (its collective failed): the dead one is found by a ping, the busy one waited
        # on for the timeout only
        assert b._dead_ranks(RuntimeError("gloo: connection closed by peer"), 0, timeout_s=5) == [1]
    stop(b)
    for k in uninterrupted:
        assert torch.equal(resumed[k], uninterrupted[k]), k


@pytest.fixture()
def in_process_deepspeed():
    """A DeepSpeed trainer built in this process (not in a rank actor) leaves process-wide state behind:
    torch.distributed's process group and the rank environment. Later tests in this process must not inherit them.
    A group that was there before (an in-process vLLM engine of an earlier test owns one) is left alone: destroyed
    under it, the engine's own teardown at exit fails ("Invalid process group specified")."""
    import torch.distributed as dist

    env, owned = dict(os.environ), not dist.is_initialized()
    yield
    if owned and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(env)


def test_zero3_builds_the_model_partitioned(tiny_model, monkeypatch, in_process_deepspeed):
    """Under ZeRO-3 the model is created inside deepspeed.zero.Init (no full fp32 copy per rank first), and only it:
    the handle that makes transformers do so is released once the trainer's model is built."""
    import deepspeed
    from transformers.integrations import is_deepspeed_zero3_enabled

    entered = []
    real = deepspeed.zero.Init.__enter__
    monkeypatch.setattr(deepspeed.zero.Init, "__enter__", lambda self: entered.append(1) or real(self))
    tr = PolicyTrainer(tiny_model, cfg(backend="deepspeed", zero_stage=3), seed=0)
    assert entered and all(hasattr(p, "ds_id") for p in tr.model.parameters())
    assert not is_deepspeed_zero3_enabled()  # a later model of this process is built whole
