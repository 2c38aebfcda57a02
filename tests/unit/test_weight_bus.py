"""rstar2.run.weight_bus: how both sides cut buckets (worked by hand), and a real gloo broadcast from this process to a
child process: floating tensors arrive in the engines' dtype, others as they are, a tensor larger than a bucket alone,
in sending order; a second sync on the same group. Real engines: tests/engine/test_collective_sync.py."""

import io
import multiprocessing as mp

import torch

from rstar2.run import weight_bus
from rstar2.run.net import free_port


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


def _receive(bus, keys, out):
    got = [[(name, t.clone()) for name, t in weight_bus.receive(weight_bus.Incoming(bus, key, 1), 0)] for key in keys]
    buf = io.BytesIO()
    torch.save(got, buf)  # as bytes: the queue's shared-memory tensors would outlive this process
    out.put(buf.getvalue())


def test_a_broadcast_reaches_another_process_cast_and_in_order():
    g = torch.Generator().manual_seed(0)
    weights = {"embed": torch.randn(50, 8, generator=g), "norm": torch.randn(8, generator=g),
               "steps": torch.arange(5), "head": torch.randn(300, 8, generator=g)}  # 4,800 bytes in bf16: a bucket alone
    bus = weight_bus.Bus("127.0.0.1", free_port(), size=2, bucket_bytes=2048, dtype="bfloat16", timeout_s=60)
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
    assert first == second == {"sync_bytes": (400 + 8 + 2400) * 2 + 5 * 8, "sync_buckets": 3}
    for sync, add in zip(got, (0, 1)):
        assert [name for name, _ in sync] == list(weights)
        for name, t in sync:
            want = weights[name] + add
            assert t.dtype == (torch.int64 if name == "steps" else torch.bfloat16)
            assert torch.equal(t, want.to(t.dtype)) and t.shape == want.shape
