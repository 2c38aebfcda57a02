"""A CUDA vLLM engine on the random Qwen3 of Qwen3-0.6B's shape: new weights reach it in place from disk (a checkpoint
directory) and from memory (a state dict, trainer.weight_sync=memory) with the same generations, and sleep/wake
(placement.colocate) frees the GPU and gives it back without changing what it generates. The reload times of both
paths are recorded as figures."""

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rstar2.rollout.chat import load_tokenizer
from rstar2.rollout.engine import EngineSpec, VLLMEngine

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("vllm_cuda")]


def moved(model_dir: str, out: Path) -> dict:
    """A copy of the model with every weight moved by noise, written to `out` and returned as a state dict."""
    shutil.copytree(model_dir, out, ignore=shutil.ignore_patterns("*.safetensors"))
    g = torch.Generator().manual_seed(0)
    sd = {k: (v.float() + 0.02 * torch.randn(v.shape, generator=g)).to(v.dtype)
          for k, v in load_file(f"{model_dir}/model.safetensors").items()}
    save_file(sd, str(out / "model.safetensors"))
    return sd


def test_weight_sync_from_disk_and_memory_and_sleep_wake(qwen06b, tmp_path, figures):
    moved_sd = moved(qwen06b, tmp_path / "moved")
    tok = load_tokenizer(qwen06b)
    prompts = [tok(f"Compute {i} * 7.")["input_ids"] for i in range(100, 108)]
    live = VLLMEngine(EngineSpec(model_dir=qwen06b, max_model_len=512, dtype="bfloat16", gpu_memory_utilization=0.3,
                                 sleep_mode=True))
    greedy = lambda: live.generate(prompts, [24] * len(prompts), temperature=0.0)  # noqa: E731
    before = greedy()
    disk_s = live.load_weights(str(tmp_path / "moved"))
    from_disk = greedy()
    live.load_weights(qwen06b)
    assert greedy() == before
    memory_s = live.load_weights(moved_sd, "moved")
    from_memory = greedy()
    assert from_memory == from_disk and from_disk != before

    free_awake = torch.cuda.mem_get_info()[0]
    live.sleep()
    assert torch.cuda.mem_get_info()[0] > free_awake + 2**30  # weights and KV cache left the GPU
    live.wake_up()
    assert greedy() == from_memory
    figures("engine_start_s", round(live.start_s, 2))
    figures("weight_sync_0.44b_disk_s", round(disk_s, 3))
    figures("weight_sync_0.44b_memory_s", round(memory_s, 3))
    live.close()
