"""Continuous batching around an engine backend (vLLM's in-process `LLMEngine`, rstar2.rollout.vllm_backend, or a toy
in unit tests): requests arrive one trajectory-turn at a time and finish independently (no per-call barrier).

One background thread (`EngineLoop`) owns the backend and is the only thread that touches it: it takes new requests
from an inbox between `step()`s and resolves each request's future the step it finishes. Callers (the in-process
engine, the Ray actor's event loop, tests) only enqueue and wait on futures.

A reload (and any work that needs a drained engine: a fingerprint, a cache reset, sleep, wake-up) pauses admission:
requests arriving meanwhile are held, in-flight ones drain first (they finish on the old weights; in the RL loop a
reload comes between steps, so there are none), then the work runs and the held requests are admitted. Draining
rather than aborting means no request is lost or redone.
"""

from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Protocol

from rstar2.core import weight_bus

# a finished turn: (new token ids, finish reason "stop" | "length", the engine's stats right after, the engine's
# log-prob of each new token when the request asked for them, else None)
TurnOut = tuple[list[int], str, dict, list[float] | None]
# new weights: a checkpoint directory (safetensors), a state dict in memory (HF parameter names -> CPU tensors), or a
# collective sync to join (trainer.weight_sync: collective)
Weights = str | dict[str, Any] | weight_bus.Incoming


class Backend(Protocol):
    """What EngineLoop drives: vLLM's LLMEngine (rstar2.rollout.vllm_backend.VLLMBackend), or a toy in unit tests."""

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
