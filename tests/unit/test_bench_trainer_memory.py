"""`rstar2 bench trainer`'s memory window is opened and read on the bench's own device: with --device cuda the base
and the peak are the GPU allocator's (a CPU RSS base under a GPU peak made `update MB` meaningless)."""

from rstar2.bench import trainer as bench_trainer
from rstar2.training import device


def test_memory_window_uses_the_bench_device(monkeypatch):
    seen = []
    monkeypatch.setattr(device, "reset_peak_memory", lambda d: seen.append(("reset", d.type)))
    monkeypatch.setattr(device, "peak_memory_mb", lambda d: seen.append(("read", d.type)) or 7.0)
    assert bench_trainer._mem_reset({"device": "cuda"}) == 7.0
    assert bench_trainer._peak({"device": "cuda"}) == 7.0
    assert seen == [("reset", "cuda"), ("read", "cuda"), ("read", "cuda")]

