"""One engine definition: `solve` starts the engine a run's config starts (tensor parallelism, vLLM's batch size,
sleep mode, KV size), on the paper's multi-GPU preset where every field differs from EngineSpec's defaults."""

import pytest

from rstar2.core import config
from rstar2.rollout.engine import EngineSpec
from rstar2.run import solve


def test_the_run_config_sets_every_engine_field():
    cfg = config.load("gpu-8x80g")
    spec = EngineSpec.of_run(cfg, "/models/m", seed=5)
    assert (spec.model_dir, spec.seed, spec.max_model_len) == ("/models/m", 5, cfg.world.max_positions)
    assert spec.tensor_parallel_size == cfg.engine.tensor_parallel_size == 4
    assert spec.sleep_mode is cfg.placement.colocate is True
    assert spec.max_num_seqs == cfg.scheduler.max_inflight
    assert spec.kv_cache_bytes == cfg.engine.kv_cache_mb * 2**20
    assert spec.gpu_memory_utilization == cfg.engine.gpu_memory_utilization


def test_solve_starts_the_runs_engine(tmp_path, monkeypatch):
    started = []

    class Refused(Exception):
        pass

    def engine(spec):
        started.append(spec)
        raise Refused

    cfg = config.load("gpu-8x80g", ["sandbox.backend=local"])
    monkeypatch.setattr(solve, "check_model_dir", lambda m: tmp_path)
    monkeypatch.setattr(solve.ChatFormat, "load", classmethod(lambda cls, path: None))
    monkeypatch.setattr(solve, "connect", lambda sandbox_cfg: None)
    monkeypatch.setattr(solve, "VLLMEngine", engine)
    with pytest.raises(Refused):
        solve.solve("m", "1 + 1?", cfg, seed=3)
    assert started == [EngineSpec.of_run(cfg, str(tmp_path), 3)]
