"""rstar2.core.weight_bus: how both sides cut buckets (worked by hand), and a real sync from this process to a child
process, through shared memory and by gloo broadcast: floating tensors arrive in the engines' dtype, others as they
are, a tensor larger than a bucket alone, in sending order; a second sync on the same bus. Real engines:
tests/engine/test_collective_sync.py."""

import io
import multiprocessing as mp
import os
from pathlib import Path

import pytest
import torch

from rstar2.core import weight_bus
from rstar2.core.net import free_port


def test_buckets_are_consecutive_one_dtype_and_at_most_the_size():
    meta = [("a", [2, 3], "float32"),    # 24 bytes
            ("b", [4], "float32"),       # 16: 40 > 32, a new bucket
            ("c", [2], "float32"),       # 8: 24
            ("d", [2], "int64"),         # another dtype: a new bucket
            ("e", [100], "float32"),     # 400 bytes: alone
            ("f", [1], "float32")]       # after it: a new bucket
    assert weight_bus.buckets(meta, 32) == [[0], [1, 2], [3], [4], [5]]
    assert weight_bus.buckets(meta, 10**6) == [[0, 1, 2], [3], [4, 5]]
    assert weight_bus.buckets([], 32) == []


def test_shared_buckets_start_at_cache_lines():
    assert weight_bus.offsets([10, 64, 0, 65]) == [0, 64, 128, 128, 256]
    assert weight_bus.offsets([]) == [0]


def _receive(bus, keys, out, rank=1, blind=False):
    if blind:  # as on another node: the offered segment is not there to map
        torch.from_file = lambda *a, **k: (_ for _ in ()).throw(FileNotFoundError("no such segment here"))
    got = [[(name, t.clone()) for name, t in weight_bus.receive(weight_bus.Incoming(bus, key, rank), 0)]
           for key in keys]
    buf = io.BytesIO()
    torch.save(got, buf)  # as bytes: the queue's shared-memory tensors would outlive this process
    out.put(buf.getvalue())


@pytest.mark.parametrize("shared", [True, False], ids=["shared-memory", "gloo"])
def test_a_broadcast_reaches_another_process_cast_and_in_order(shared):
    g = torch.Generator().manual_seed(0)
    weights = {"embed": torch.randn(50, 8, generator=g), "norm": torch.randn(8, generator=g),
               # head: 4,800 bytes in bf16, a bucket alone
               "steps": torch.arange(5), "head": torch.randn(300, 8, generator=g)}
    bus = weight_bus.Bus("127.0.0.1", free_port(), size=2, bucket_bytes=2048, dtype="bfloat16", timeout_s=60,
                         shared_memory=shared)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_receive, args=(bus, [0, 1], out))
    child.start()
    try:
        first = weight_bus.send(bus, 0, weights.items())
        second = weight_bus.send(bus, 1, {k: v + 1 for k, v in weights.items()}.items())
        got = torch.load(io.BytesIO(out.get(timeout=60)))
    finally:
        weight_bus.close()
        child.join(timeout=30)
    assert first == second == {"sync_bytes": (400 + 8 + 2400) * 2 + 5 * 8, "sync_buckets": 3,
                               "sync_shared": int(shared)}
    assert not list(Path(weight_bus.SHM_DIR).glob(f"rstar2-weights-{os.getpid()}-*"))  # unlinked once taken
    for sync, add in zip(got, (0, 1)):
        assert [name for name, _ in sync] == list(weights)
        for name, t in sync:
            want = weights[name] + add
            assert t.dtype == (torch.int64 if name == "steps" else torch.bfloat16)
            assert torch.equal(t, want.to(t.dtype)) and t.shape == want.shape


def test_a_member_that_cannot_map_the_segment_makes_the_bus_broadcast():
    weights = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "n": torch.arange(3)}
    bus = weight_bus.Bus("127.0.0.1", free_port(), size=3, bucket_bytes=32, timeout_s=60)
    ctx = mp.get_context("spawn")
    outs = [ctx.Queue(), ctx.Queue()]
    children = [ctx.Process(target=_receive, args=(bus, [0], out, rank, rank == 2))
                for rank, out in zip((1, 2), outs)]
    for child in children:
        child.start()
    try:
        sent = weight_bus.send(bus, 0, weights.items())
        got = [torch.load(io.BytesIO(out.get(timeout=60))) for out in outs]
    finally:
        weight_bus.close()
        for child in children:
            child.join(timeout=30)
    assert sent == {"sync_bytes": 48 + 24, "sync_buckets": 2, "sync_shared": 0}
    for (sync,) in got:
        assert [(name, t.tolist()) for name, t in sync] == [(name, t.tolist()) for name, t in weights.items()]
    assert not list(Path(weight_bus.SHM_DIR).glob(f"rstar2-weights-{os.getpid()}-*"))
