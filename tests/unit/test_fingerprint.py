"""The weights' content fingerprint (rstar2.core.fingerprint) on hand-made tensors, and the controller's check after a
sync (rstar2.run.engine_actors `check_weights`) against engines that hold the checkpoint, an older one, or another
dtype's rounding of it. Real vLLM engines: tests/engine/test_weight_sync.py."""

import pytest
import torch
from safetensors.torch import save_file

from rstar2.core import fingerprint
from rstar2.core.fingerprint import WeightSyncError


def _weights(scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"model.layers.0.input_layernorm.weight": 1 + scale * 0.01 * torch.randn(8, generator=g),
            "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=g),
            "model.norm.weight": torch.ones(8) * (1 + scale * 1e-6)}


def test_only_norm_scales_in_name_order_in_the_engines_dtype():
    w = _weights()
    fp = fingerprint.of_tensors(w.items(), torch.float32)
    assert fp.startswith("2:")  # the two norm scales; the packed linear layer is not read back
    assert fingerprint.of_tensors(reversed(list(w.items())), torch.float32) == fp  # order of arrival does not matter
    moved = {**w, "model.layers.0.self_attn.q_proj.weight": w["model.layers.0.self_attn.q_proj.weight"] + 1}
    assert fingerprint.of_tensors(moved.items(), torch.float32) == fp  # (the log-prob gap covers that one)
    assert fingerprint.of_tensors(_weights(2.0).items(), torch.float32) != fp  # an update moves the scales
    # a 1e-6 step is below bf16's resolution at 1.0: bf16 engines holding either copy agree, fp32 ones do not
    tiny = {**w, "model.norm.weight": torch.ones(8)}
    assert fingerprint.of_tensors(tiny.items(), torch.bfloat16) == fingerprint.of_tensors(w.items(), torch.bfloat16)
    assert fingerprint.of_tensors(tiny.items(), torch.float32) != fp
    assert fingerprint.of_tensors({"lm_head.weight": torch.ones(2, 2)}.items(), torch.float32) is None


def test_a_checkpoint_directory_is_fingerprinted_from_its_safetensors(tmp_path):
    save_file(_weights(), str(tmp_path / "model.safetensors"))
    assert fingerprint.of_checkpoint(tmp_path, "float32") == fingerprint.of_tensors(_weights().items(), torch.float32)
    assert fingerprint.of_checkpoint(tmp_path / "missing", "float32") is None  # no safetensors: nothing to compare


class _Remote:
    def __init__(self, value):
        self.value = value

    def remote(self):
        return self.value


class _Engine:
    def __init__(self, served):
        self.fingerprint = _Remote(served)


def test_the_sync_check_names_the_engine_that_kept_other_weights(tmp_path, monkeypatch):
    from rstar2.run import engine_actors

    monkeypatch.setattr(engine_actors.ray, "get", lambda refs: refs)  # the engines' answers, as Ray returns them
    save_file(_weights(), str(tmp_path / "model.safetensors"))
    now = fingerprint.of_checkpoint(tmp_path, "float32")
    old = fingerprint.of_tensors(_weights(2.0).items(), torch.float32)
    engines = engine_actors.EngineActors("run")
    bf16 = fingerprint.of_checkpoint(tmp_path, "bfloat16")
    engines.handles = [_Engine(("float32", now)), _Engine(("bfloat16", bf16))]
    engines.calibrate_fingerprint(str(tmp_path))
    engines.check_weights(str(tmp_path))  # each engine against the checkpoint in its own dtype
    engines.handles.append(_Engine(("float32", old)))
    with pytest.raises(WeightSyncError, match=f"engine 2 {old} against the checkpoint's"):
        engines.check_weights(str(tmp_path))
    engines.check_weights(str(tmp_path / "no-safetensors"))  # nothing to compare against: no verdict


def test_a_model_whose_loader_transforms_the_norms_turns_the_check_off_at_start(tmp_path, monkeypatch, caplog):
    """Engines just started from a directory hold its weights: a mismatch then is the model family's loader (a norm
    stored as 1 + w), not a lost sync, so the run goes on without the check and says so once."""
    from rstar2.run import engine_actors

    monkeypatch.setattr(engine_actors.ray, "get", lambda refs: refs)
    save_file(_weights(), str(tmp_path / "model.safetensors"))
    engines = engine_actors.EngineActors("run")
    engines.handles = [_Engine(("float32", fingerprint.of_tensors(_weights(2.0).items(), torch.float32)))]
    with caplog.at_level("WARNING", logger=engine_actors.__name__):
        engines.calibrate_fingerprint(str(tmp_path))
    assert not engines.fingerprints_comparable and len(caplog.messages) == 1
    assert caplog.messages[0].startswith("weight fingerprints are not comparable for this model, so not checked")
    engines.check_weights(str(tmp_path))  # off for the run: no verdict
