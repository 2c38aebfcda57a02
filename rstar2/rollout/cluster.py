"""Ray in the driver: joining the cluster, and the engine actors' clients. The actors themselves are started and
owned by the run's controller (rstar2.run.engine_actors).

Local by default (`ray.init()` on this machine); set RAY_ADDRESS to join a cluster.
"""

from __future__ import annotations

import itertools
import os
import threading
import uuid
from concurrent.futures import Future

import ray

NAMESPACE = "rstar2"
MAX_CONCURRENT_CALLS = 4096  # an engine actor's calls waiting at once (turns in flight + probes)
_STATE_ENV = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CACHE_ROOT", "VLLM_RPC_BASE_PATH", "VLLM_CONFIGURE_LOGGING",
              "HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "TORCH_EXTENSIONS_DIR", "TMPDIR",
              "VLLM_NO_USAGE_STATS", "TOKENIZERS_PARALLELISM", "RSTAR2_SANDBOX_PYTHON")


def init() -> None:
    if ray.is_initialized():
        return
    env = {k: os.environ[k] for k in _STATE_ENV if k in os.environ}
    runtime_env = {"env_vars": env}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(namespace=NAMESPACE, runtime_env=runtime_env, log_to_driver=False)
    else:  # Ray's state under RSTAR2_HOME (set by rstar2.cli.env's defaults), else where Ray keeps it by default
        home = os.environ.get("RSTAR2_HOME")
        tmp = os.path.join(home, "ray") if home else None
        ray.init(namespace=NAMESPACE, runtime_env=runtime_env, include_dashboard=False, log_to_driver=False,
                 num_cpus=os.cpu_count(), _temp_dir=tmp if tmp and len(tmp) < 60 else None)


class EngineClient:
    """One engine actor as the agent loop (rstar2.rollout.agent_loop) sees it: `submit` one trajectory-turn, `probe` its
    stats; both return concurrent futures, so the agent loop waits on turns, tool calls and probes of every engine
    at once. The client has no thread of its own.

    Turns travel in batches both ways, and the caller's thread pumps both (the agent loop calls `flush` on every
    pass): `flush` sends every turn submitted since the last one in one `add_turns` call, and, while turns are out,
    sends a `collect` unless one is in flight: a long poll that returns as soon as turns have finished, with every
    turn finished since the one before (the actor keeps each client's turns apart). Its answer resolves the turns'
    futures, which wakes the agent loop, whose next pass sends the next collect. No Ray call is made from Ray's
    completion callbacks (they run on Ray's own I/O thread, which a call made there can block). A Ray call costs
    ~0.8 ms of the driver's CPU and ~2 ms of the engine process's on this machine, and at the paper's scale one
    driver sends ~16K trajectories x turns per step."""

    POLL_S = 30.0  # a collect with nothing finished returns after this long (the next pass sends another)

    def __init__(self, handle, temperature: float, top_p: float, block_size: int = 1, logprobs: bool = False):
        self.handle, self.temperature, self.top_p = handle, temperature, top_p
        self.logprobs = logprobs  # every turn also returns the engine's log-prob of each sampled token
        self.block_size = block_size  # vLLM's KV block in tokens: the scheduler counts KV in whole blocks
        self._lock = threading.Lock()
        self._outgoing: list[tuple] = []  # (key, prompt, max_tokens, seed, priority), not sent yet
        self._pending: dict[int, Future] = {}  # sent or about to be, not back yet
        self._keys = itertools.count()
        self._collecting = False  # a collect is in flight
        self._id = uuid.uuid4().hex  # the actor keeps each client's finished turns apart

    def submit(self, prompt: list[int], max_tokens: int, seed: int | None = None, priority: int = 0) -> Future:
        """Queue one turn; it goes out with the next `flush`."""
        fut: Future = Future()
        with self._lock:
            key = next(self._keys)
            self._pending[key] = fut
            self._outgoing.append((key, prompt, max_tokens, seed, priority))
        return fut

    def flush(self) -> None:
        """Send the turns submitted since the last flush in one call, and keep a collect in flight for them."""
        with self._lock:
            batch, self._outgoing = self._outgoing, []
        if batch:
            keys = [t[0] for t in batch]
            try:
                ref = self.handle.add_turns.remote(self._id, batch, self.temperature, self.top_p, self.logprobs)
            except Exception as err:  # noqa: BLE001 - the actor is gone: its turns fail, the caller requeues
                self._resolve([(k, None, repr(err), None, None) for k in keys])
            else:
                ref.future().add_done_callback(lambda f, keys=keys: self._sent(f, keys))
        self._collect()

    def probe(self):
        return self.handle.stats.remote().future()

    def cancel(self) -> None:
        """Abort the turns still out (a partial rollout's cut): the actor drops them; their futures fail here."""
        with self._lock:
            keys, self._outgoing = list(self._pending), []
        self._resolve([(k, None, "cancelled", None, None) for k in keys])
        try:
            self.handle.cancel_turns.remote(self._id)
        except Exception:  # noqa: BLE001 - a dead actor has nothing left to abort
            pass

    def _sent(self, fut: Future, keys: list[int]) -> None:
        """`add_turns` answered: if it failed, so did its turns."""
        if fut.exception() is not None:
            self._resolve([(k, None, repr(fut.exception()), None, None) for k in keys])

    def _collect(self) -> None:
        """A collect in flight while turns are out, at most one (none when none are)."""
        with self._lock:
            if self._collecting or not self._pending:
                return
            self._collecting = True
        try:
            ref = self.handle.collect.remote(self._id, self.POLL_S)
        except Exception as err:  # noqa: BLE001 - a dead actor: every turn out there fails
            self._collected_with([], err)
            return
        ref.future().add_done_callback(self._collected)

    def _collected(self, fut: Future) -> None:
        err = fut.exception()
        self._collected_with([] if err is not None else fut.result(), err)

    def _collected_with(self, done: list[tuple], err: BaseException | None) -> None:
        """A collect's answer (or its failure: every turn out there fails); the next flush sends the next one."""
        if err is not None:
            with self._lock:
                keys = list(self._pending)
            done = [(k, None, repr(err), None, None) for k in keys]
        with self._lock:
            self._collecting = False
        self._resolve(done)

    def _resolve(self, done: list[tuple]) -> None:
        with self._lock:
            futs = [(self._pending.pop(key, None), rest) for key, *rest in done]
        for fut, (ids, finish, stats, logprobs) in futs:
            if fut is None or fut.done():
                continue
            if ids is None:
                fut.set_exception(RuntimeError(f"engine turn failed: {finish}"))
            else:
                fut.set_result((ids, finish, stats, logprobs))
