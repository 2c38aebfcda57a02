"""A vLLM engine in this process, with blocking methods (`VLLMEngine`: `rstar2 solve`, tests, and the base of the Ray
actor, rstar2.rollout.engine_actor), and `LocalClient`, such an engine as the agent loop's engine client.

The engine is vLLM's in-process `LLMEngine` (rstar2.rollout.vllm_backend) driven by one loop thread
(rstar2.rollout.engine_loop): every method here enqueues on that loop and waits on the future it returns.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future

from rstar2.rollout.engine_loop import EngineLoop, Weights
from rstar2.rollout.vllm_backend import EngineSpec, VLLMBackend


class VLLMEngine:
    """The engine, usable in-process with blocking methods; rstar2.rollout.engine_actor.EngineActor is its Ray face."""

    def __init__(self, spec: EngineSpec):
        t0 = time.perf_counter()
        self._backend = VLLMBackend(spec)
        self.start_s = time.perf_counter() - t0
        self.weights_version = spec.model_dir
        self.loop = EngineLoop(self._backend, name=f"vllm-loop-{spec.seed}")

    def generate(self, prompts: list[list[int]], max_tokens: list[int], temperature: float = 1.0,
                 top_p: float = 1.0, seeds: list[int | None] | None = None) -> list[tuple[list[int], str]]:
        """One assistant turn per prompt: (new token ids, finish reason "stop" | "length"), all admitted at once."""
        return [f.result()[:2] for f in self.loop.submit_many(prompts, max_tokens, temperature, top_p, seeds)]

    def replay(self, chains: list[list[tuple[list[int], int, int | None]]], temperature: float = 1.0,
               top_p: float = 1.0) -> list[list[tuple[list[int], str]]]:
        """Every chain's turns, each the moment the one before it finishes (EngineLoop.submit_chains)."""
        return [f.result() for f in self.loop.submit_chains(chains, temperature, top_p)]

    def load_weights(self, weights: Weights, version: str | None = None) -> float:
        """Reload weights in place from a checkpoint directory (safetensors) or a state dict (name -> tensor, HF
        names); `version` names what it holds now (default: the directory). Returns seconds taken."""
        took = self.loop.reload(weights).result()
        self.weights_version = version or (weights if isinstance(weights, str) else "memory")
        return took

    def reset_cache(self) -> float:
        return self.loop.reset_cache().result()

    def fingerprint(self) -> tuple[str, str | None]:
        """(dtype, content fingerprint) of the weights this engine serves (rstar2.core.fingerprint)."""
        return self.loop.fingerprint().result()

    def sleep(self) -> float:
        """Free the GPU for a colocated trainer's update once in-flight requests are done; seconds taken."""
        return self.loop.sleep().result()

    def wake_up(self) -> float:
        return self.loop.wake_up().result()

    def info(self) -> dict:
        return {"start_s": self.start_s, "weights": self.weights_version, "pid": os.getpid(),
                "dtype": self._backend.dtype(), **self._backend.capacity()}

    def stats(self) -> dict:
        return self.loop.stats()

    def client(self, temperature: float, top_p: float = 1.0, logprobs: bool = False) -> "LocalClient":
        """This engine as the agent loop's engine client, in-process (no Ray): `rstar2 solve`, tests."""
        return LocalClient(self, temperature, top_p, logprobs)

    def close(self) -> None:
        self.loop.close()


class LocalClient:
    """An in-process VLLMEngine as the agent loop sees an engine (rstar2.rollout.agent_loop.EngineClient); the Ray face
    of the same is rstar2.rollout.cluster.EngineClient. `capacity`: the engine's KV capacity in tokens."""

    def __init__(self, engine: VLLMEngine, temperature: float, top_p: float, logprobs: bool):
        self.engine, self.temperature, self.top_p, self.logprobs = engine, temperature, top_p, logprobs
        self._out: set[Future] = set()  # its turns in flight
        self._lock = threading.Lock()
        info = engine.info()
        self.block_size, self.capacity = int(info["block_size"] or 1), int(info["kv_capacity_tokens"])

    def submit(self, prompt: list[int], max_tokens: int, seed: int | None = None, priority: int = 0) -> Future:
        fut = self.engine.loop.submit(prompt, max_tokens, self.temperature, self.top_p, seed, priority, self.logprobs)
        with self._lock:
            self._out.add(fut)
        fut.add_done_callback(self._back)
        return fut

    def _back(self, fut: Future) -> None:
        with self._lock:
            self._out.discard(fut)

    def cancel(self) -> None:
        """Abort this client's turns still in flight (a partial rollout's cut)."""
        with self._lock:
            out = list(self._out)
        self.engine.loop.abort(out)

    def probe(self) -> Future:
        fut: Future = Future()
        fut.set_result(self.engine.stats())
        return fut

    def flush(self) -> None:
        """Nothing to send: `submit` hands each turn to the engine's loop at once."""
