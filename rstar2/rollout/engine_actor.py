"""The engine as a Ray actor (rstar2.run.engine_actors starts a run's): an asyncio actor around the in-process engine
(rstar2.rollout.engine.VLLMEngine), whose event loop holds any number of waiting turns while the engine's loop thread
generates. A client (rstar2.rollout.cluster.EngineClient) sends its turns in batches (`add_turns`) and long-polls
their results (`collect`).
"""

from __future__ import annotations

import asyncio

from rstar2.rollout.engine import VLLMEngine
from rstar2.rollout.engine_loop import Weights
from rstar2.rollout.vllm_backend import EngineSpec


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
