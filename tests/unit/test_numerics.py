"""The trainer's numerics (rstar2.training.numerics): trainer.dtype auto takes bf16 only where the hardware multiplies
it fast; a run states what it took in its config and keeps it when resumed."""

import json

import pytest
import torch

from rstar2.core import config
from rstar2.run import plan
from rstar2.training import numerics

CPU = torch.device("cpu")


def _cpu_bf16(monkeypatch, avx512_bf16: bool, amx: bool = False) -> None:
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)


def test_a_host_without_fast_bf16_runs_fp32(monkeypatch):
    _cpu_bf16(monkeypatch, False)
    assert numerics.choose("auto", CPU) == numerics.Choice("float32", "this cpu has no fast bf16")


@pytest.mark.parametrize("avx512_bf16,amx", [(True, False), (False, True), (True, True)])
def test_a_cpu_with_avx512_bf16_or_amx_runs_bf16(monkeypatch, avx512_bf16, amx):
    _cpu_bf16(monkeypatch, avx512_bf16, amx)
    assert numerics.choose("auto", CPU).dtype == "bfloat16"


def test_a_gpu_runs_bf16_where_it_has_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **kw: True)
    assert numerics.choose("auto", torch.device("cuda")).dtype == "bfloat16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **kw: False)  # e.g. a V100
    assert numerics.choose("auto", torch.device("cuda")).dtype == "float32"


def test_a_dtype_set_in_the_config_is_kept_and_a_wrong_one_refused(monkeypatch):
    _cpu_bf16(monkeypatch, False)
    assert numerics.choose("bfloat16", CPU) == numerics.Choice("bfloat16", "set in the config")
    _cpu_bf16(monkeypatch, True)
    assert numerics.choose("float32", CPU).dtype == "float32"
    with pytest.raises(ValueError, match="trainer.dtype must be auto, float32 or bfloat16, got 'fp16'"):
        numerics.choose("fp16", CPU)


def test_a_run_states_its_numerics_in_its_config_and_keeps_them_on_resume(monkeypatch, tmp_path):
    cfg = config.load("tiny", ["trainer.dtype=auto"])
    _cpu_bf16(monkeypatch, True)
    settled, why = plan.settle_numerics(cfg)
    assert settled.trainer.dtype == "bfloat16" and "multiplies bf16 in hardware" in why and cfg.trainer.dtype == "auto"
    previous = tmp_path / "config.json"
    previous.write_text(settled.model_dump_json())
    _cpu_bf16(monkeypatch, False)  # resumed on a host without it: the run keeps the numerics it started with
    again, why = plan.settle_numerics(cfg, previous)
    assert again.trainer.dtype == "bfloat16" and "as the run started" in why
    assert json.loads(again.model_dump_json())["trainer"]["dtype"] == "bfloat16"
    assert plan.settle_numerics(cfg)[0].trainer.dtype == "float32"  # a new run on it: fp32
    fixed, why = plan.settle_numerics(config.load("tiny", ["trainer.dtype=float32"]), previous)
    assert fixed.trainer.dtype == "float32" and "set in the config" in why


def test_a_gpu_run_planned_from_a_machine_without_one_leaves_it_to_the_ranks(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = config.load("tiny", ["trainer.dtype=auto", "placement.gpus=8"])
    settled, why = plan.settle_numerics(cfg)
    assert settled.trainer.dtype == "auto" and "each trainer rank" in why


def test_the_trainer_and_sft_settle_auto_themselves(monkeypatch, tmp_path):
    from rstar2.bench import trainer_shapes
    from rstar2.core.config import TrainerCfg
    from rstar2.training.trainer import PolicyTrainer

    trainer_shapes.write_model("tiny", tmp_path / "m")
    _cpu_bf16(monkeypatch, False)
    assert PolicyTrainer(str(tmp_path / "m"), TrainerCfg(dtype="auto")).cfg.dtype == "float32"
    _cpu_bf16(monkeypatch, True)
    assert PolicyTrainer(str(tmp_path / "m"), TrainerCfg(dtype="auto")).cfg.dtype == "bfloat16"


@pytest.mark.parametrize("segments", [None, [[(0, 5, 0, 0), (5, 8, 0, 0)]]])
def test_attention_computes_in_fp32_under_bf16_autocast_on_a_cpu(segments):
    """CPU flash attention's bf16 backward is slower than its fp32 one: under autocast the trainer's attention
    (plain or packed) takes q, k, v in fp32, exactly as an fp32 forward would."""
    import types

    from rstar2.training.batching import varlen_attention

    module = types.SimpleNamespace(is_causal=True, num_key_value_groups=1, training=False)
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))                                   # (B, H, T, D)
    ref, _ = varlen_attention(module, q, k, v, None, scaling=0.5, rstar2_segments=segments)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = varlen_attention(module, q, k, v, None, scaling=0.5, rstar2_segments=segments)
    assert out.dtype == torch.float32 and torch.equal(out, ref)
