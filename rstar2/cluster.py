"""Ray: the single controller (the driver, i.e. the Prefect flow process) owns named engine and trainer actors.

Local by default (`ray.init()` on this machine); set RAY_ADDRESS to join a cluster. Actors are non-detached, so
they die with the driver; they are looked up by name, so Prefect tasks pass names (small strings), not handles.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import uuid
from concurrent.futures import Future

import ray

from rstar2.agent_loop import EngineSet
from rstar2.config import RunCfg
from rstar2.engine import EngineActor, EngineSpec
from rstar2.trainer import PolicyTrainer
from rstar2.trainer_group import TrainerGroup

NAMESPACE = "rstar2"
MAX_CONCURRENT_CALLS = 4096  # an engine actor's calls waiting at once (turns in flight + probes)
_HANDLES: dict[str, object] = {}  # a non-detached actor lives while the driver holds a handle to it
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
    else:
        tmp = os.path.join(os.environ.get("RSTAR2_HOME", "/tmp/rstar2"), "ray")
        ray.init(namespace=NAMESPACE, runtime_env=runtime_env, include_dashboard=False, log_to_driver=False,
                 num_cpus=os.cpu_count(), _temp_dir=tmp if len(tmp) < 60 else None)


def actor_names(run_id: str, num_engines: int) -> tuple[list[str], str]:
    return [f"{run_id}-engine-{i}" for i in range(num_engines)], f"{run_id}-trainer"


def start(run_id: str, cfg: RunCfg, model_dir: str, with_trainer: bool = True) -> tuple[list[str], str | None]:
    """Create the engines and (unless evaluating only) the trainer, if not already alive under these names;
    returns their names."""
    init()
    engine_names, trainer_name = actor_names(run_id, cfg.engine.num_engines)
    gpu = 1 if cfg.engine.gpu_memory_utilization else 0
    threads = os.cpu_count()
    for i, name in enumerate(engine_names):
        if _alive(name):
            continue
        # the engine's own seed is the world's: engines serve evaluation and every RL seed, and each trajectory-turn
        # carries its own sampling seed (rstar2.rollout.Trajectory.turn_seed), so this one picks no sample
        spec = EngineSpec(model_dir=model_dir, max_model_len=cfg.world.max_positions, dtype=cfg.engine.dtype,
                          kv_cache_bytes=cfg.engine.kv_cache_mb * 2**20, seed=cfg.seed + i,
                          gpu_memory_utilization=cfg.engine.gpu_memory_utilization, block_size=cfg.engine.block_size)
        # num_cpus=0: on a 2-core laptop engines and trainer take turns, they never run at once. An async actor:
        # its event loop holds every waiting turn while the engine's own thread generates (rstar2.engine)
        _HANDLES[name] = ray.remote(num_cpus=0, num_gpus=gpu)(EngineActor).options(
            name=name, max_concurrency=MAX_CONCURRENT_CALLS).remote(spec)
    if not with_trainer:
        trainer_name = None
    elif not _alive(trainer_name):
        # world_size > 1: a coordinator actor (no GPU) fronting one DeepSpeed rank actor per GPU
        cls, gpus = (TrainerGroup, 0) if cfg.trainer.world_size > 1 else (PolicyTrainer, gpu)
        _HANDLES[trainer_name] = ray.remote(num_cpus=0, num_gpus=gpus)(cls).options(
            name=trainer_name).remote(model_dir, cfg.trainer, cfg.rl_seed, threads)
    for name in engine_names + ([trainer_name] if trainer_name else []):
        ray.get(get(name).__ray_ready__.remote())
    return engine_names, trainer_name


def restart_trainer(run_id: str, cfg: RunCfg, model_dir: str, timeout_s: float = 60.0) -> str:
    """A fresh trainer under the run's trainer name: weights from `model_dir`, seed cfg.rl_seed, a new optimizer and
    LR schedule; the engines are kept (the seed axis: every seed's RL starts from the SFT model). Returns its name."""
    _, name = actor_names(run_id, cfg.engine.num_engines)
    stop([name])
    deadline = time.monotonic() + timeout_s
    while _alive(name):  # Ray releases a killed actor's name asynchronously
        if time.monotonic() > deadline:
            raise TimeoutError(f"trainer {name} still registered {timeout_s:.0f} s after it was killed")
        time.sleep(0.2)
    return start(run_id, cfg, model_dir)[1]


def _alive(name: str) -> bool:
    try:
        ray.get_actor(name, namespace=NAMESPACE)
        return True
    except ValueError:
        return False


def get(name: str):
    init()
    return ray.get_actor(name, namespace=NAMESPACE)


def stop(names: list[str]) -> None:
    for name in names:
        if _alive(name):
            ray.kill(get(name))
        _HANDLES.pop(name, None)


class EngineClient:
    """One engine actor as the agent loop (rstar2.agent_loop) sees it: `submit` one trajectory-turn, `probe` its
    stats; both return concurrent futures, so the agent loop waits on turns, tool calls and probes of every engine
    at once.

    Turns travel in batches both ways: a sender thread sends whatever was submitted since its last call in one
    `add_turns` call, and while turns are out a collector thread keeps one `collect` in flight (a long poll that
    returns every turn finished since the one before; the actor keeps each client's turns apart). A Ray call costs
    ~0.8 ms of the driver's CPU and ~2 ms of the engine process's on this machine (the rollout bench's replay
    reference put the agent loop's own CPU at ~30 % of its throughput), and at the paper's scale one driver sends
    ~16K trajectories x turns per step. Both threads end after IDLE_EXIT_S without work (a client per RL step leaves
    none behind); the next submit starts them again."""

    IDLE_EXIT_S = 2.0
    POLL_S = 1.0  # a collect returns after this long even with nothing finished (the collector then re-checks)

    def __init__(self, handle, temperature: float, top_p: float, block_size: int = 1):
        self.handle, self.temperature, self.top_p = handle, temperature, top_p
        self.block_size = block_size  # vLLM's KV block in tokens: the scheduler counts KV in whole blocks
        self._cv = threading.Condition()
        self._outgoing: list[tuple] = []  # (key, prompt, max_tokens, seed, priority), not sent yet
        self._pending: dict[int, Future] = {}  # sent or about to be, not back yet
        self._keys = itertools.count()
        self._threads: dict[str, threading.Thread | None] = {"send": None, "collect": None}
        self._id = uuid.uuid4().hex  # the actor keeps each client's finished turns apart

    def submit(self, prompt: list[int], max_tokens: int, seed: int | None = None, priority: int = 0) -> Future:
        fut: Future = Future()
        with self._cv:
            key = next(self._keys)
            self._pending[key] = fut
            self._outgoing.append((key, prompt, max_tokens, seed, priority))
            for name, loop in (("send", self._send_loop), ("collect", self._collect_loop)):
                if self._threads[name] is None:
                    self._threads[name] = threading.Thread(target=loop, name=f"engine-client-{name}", daemon=True)
                    self._threads[name].start()
            self._cv.notify_all()
        return fut

    def probe(self):
        return self.handle.stats.remote().future()

    def _idle(self, name: str, has_work) -> bool:
        """Wait (holding the lock) for work; False when none came for IDLE_EXIT_S: the thread is then unregistered
        and must return."""
        while not has_work():
            if not self._cv.wait(self.IDLE_EXIT_S) and not has_work():
                self._threads[name] = None
                return False
        return True

    def _send_loop(self) -> None:
        while True:
            with self._cv:
                if not self._idle("send", lambda: self._outgoing):
                    return
                batch, self._outgoing = self._outgoing, []
            keys = [t[0] for t in batch]
            try:
                ref = self.handle.add_turns.remote(self._id, batch, self.temperature, self.top_p)
            except Exception as err:  # noqa: BLE001 - the actor is gone: its turns fail, the caller requeues
                self._resolve([(k, None, repr(err), None) for k in keys])
                continue
            ref.future().add_done_callback(lambda f, keys=keys: self._sent(f, keys))

    def _sent(self, fut: Future, keys: list[int]) -> None:
        """`add_turns` answered: if it failed, so did its turns."""
        if fut.exception() is not None:
            self._resolve([(k, None, repr(fut.exception()), None) for k in keys])

    def _collect_loop(self) -> None:
        while True:
            with self._cv:
                if not self._idle("collect", lambda: self._pending):
                    return
            try:
                done = ray.get(self.handle.collect.remote(self._id, self.POLL_S))
            except Exception as err:  # noqa: BLE001 - a dead actor: every turn out there fails
                with self._cv:
                    keys = list(self._pending)
                done = [(k, None, repr(err), None) for k in keys]
            self._resolve(done)

    def _resolve(self, done: list[tuple]) -> None:
        with self._cv:
            futs = [(self._pending.pop(key, None), rest) for key, *rest in done]
        for fut, (ids, finish, stats) in futs:
            if fut is None or fut.done():
                continue
            if ids is None:
                fut.set_exception(RuntimeError(f"engine turn failed: {finish}"))
            else:
                fut.set_result((ids, finish, stats))


def engine_clients(engine_names: list[str], temperature: float, top_p: float) -> EngineSet:
    """A client per engine (for the agent loop) and each engine's KV capacity in tokens, as vLLM sized it
    (num_gpu_blocks x block_size)."""
    engines = [get(n) for n in engine_names]
    infos = ray.get([e.info.remote() for e in engines])
    caps = [int(i["kv_capacity_tokens"]) for i in infos]
    return EngineSet([EngineClient(e, temperature, top_p, int(i["block_size"] or 1)) for e, i in zip(engines, infos)],
                     caps)
