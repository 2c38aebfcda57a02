"""The agent loop: one rollout of many multi-turn trajectories on vLLM engines with the Python tool (paper §2.1,
§3.2). The RL step, evaluation and hard-sample mining all roll out through it.

No barrier: the scheduler (rstar2.rollout.scheduler, through a SchedulerSession) places each trajectory on one engine
(sticky), and each trajectory's next turn goes to its engine the moment it is ready (placed, or its tool reply in); the
engine batches whatever is in flight (continuous batching, rstar2.rollout.engine_loop) and every turn comes back on its
own. A tool call goes to the sandbox as it is (`Sandbox.submit`: a future), so one trajectory's sandbox time overlaps
the others' generation; the sandbox alone bounds the calls in flight (its workers and queue), the loop adds no pool.

Everything that completes (a turn, a tool call, an engine probe) becomes an event on one queue, handled by the
loop's thread in arrival order: `TurnDone`, `ToolDone`, `Probed`, `EngineError`. An engine that fails, or hangs
(no probe answer / no progress for `hang_timeout_s`), has its trajectories requeued to the others; they resume from
their last completed turn, and any later event from the dead engine is dropped (a turn is applied at most once).

A partial rollout (a `quota` of groups, rstar2.rollout.partial) takes trajectories carried over from the step
before, holds those its cut has passed, and ends once the cut is settled, aborting the turns still in flight.
"""

from __future__ import annotations

import queue
import time
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Protocol

import numpy as np

from rstar2.core.config import SchedulerCfg
from rstar2.rollout.chat import ChatFormat
from rstar2.rollout.estimator import LengthEstimator
from rstar2.rollout.partial import Cut
from rstar2.rollout.scheduler import CUT, END, TOOL, TURN, Scheduler, SchedulerSession
from rstar2.rollout.trajectory import (
    Pending,
    RolloutLimits,
    Sandbox,
    Trajectory,
    make_trajs,
    model_turn,
    tool_result,
    tool_turn,
)


class EngineClient(Protocol):
    """One engine as the agent loop drives it (rstar2.rollout.cluster.EngineClient for a vLLM engine actor)."""

    block_size: int  # vLLM's KV block in tokens

    def submit(self, prompt: list[int], max_tokens: int, seed: int | None = None, priority: int = 0) -> Future:
        """One trajectory-turn; the future resolves to (new ids, finish reason, the engine's stats after it, the
        sampled tokens' log-probs or None when the client does not ask for them). priority: the engine's (vLLM's:
        lower runs first and is preempted last)."""

    def probe(self) -> Future:
        """The engine's stats: kv_usage (fraction of KV blocks in use), preemptions (cumulative), steps (engine
        iterations so far: its progress)."""

    def flush(self) -> None:
        """Send what was submitted since the last flush (a client may batch its turns until then)."""

    def cancel(self) -> None:
        """Abort this client's turns in flight (a partial rollout's cut); their futures may never resolve."""


class EngineSet(NamedTuple):
    """The engines a rollout runs on: a client each and its KV capacity in tokens."""
    clients: list[EngineClient]
    capacities: list[int]


# ---- events ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TurnDone:
    engine: int
    tid: int
    ids: list[int]
    finish: str
    stats: dict
    logprobs: list[float] | None


@dataclass(frozen=True)
class ToolDone:
    tid: int
    pending: Pending
    future: Future  # of sandbox.submit(the call): read on the loop's thread, so a sandbox error stops the rollout
    sent_at: float


@dataclass(frozen=True)
class Probed:
    engine: int
    stats: dict


@dataclass(frozen=True)
class EngineError:
    engine: int
    error: str


def _turn_event(e: int, tid: int, f: Future) -> TurnDone | EngineError:
    try:
        ids, finish, stats, logprobs = f.result()
    except Exception as err:  # noqa: BLE001 - a dead or broken engine: requeue, the batch completes
        return EngineError(e, repr(err))
    return TurnDone(e, tid, ids, finish, stats, logprobs)


def _probe_event(e: int, f: Future) -> Probed | EngineError:
    try:
        return Probed(e, f.result())
    except Exception as err:  # noqa: BLE001
        return EngineError(e, repr(err))


def _groups(trajs: list[Trajectory]) -> list[list[int]]:
    """Indices of each problem's trajectories, problems in order of first appearance."""
    out: dict[str, list[int]] = {}
    for i, t in enumerate(trajs):
        out.setdefault(t.problem_id, []).append(i)
    return list(out.values())


def _clock(t: Trajectory) -> int:
    """A partial rollout's clock for t: the model tokens it generated in this rollout (rstar2.rollout.partial)."""
    return sum(t.loss_mask[t.turn_starts[t.step_turns]:]) if t.num_turns > t.step_turns else 0


# ---- one engine, as the loop sees it -----------------------------------------------------------------------------
@dataclass
class EngineWatch:
    """Turns in flight, liveness and vLLM's stats of one engine during a rollout."""
    alive: bool = True
    inflight: int = 0
    busy_since: float | None = None
    busy_s: float = 0.0
    progress_at: float = 0.0  # last sign of progress: a turn came back or its step counter moved
    steps: int = -1
    probe_sent: float | None = None  # a probe is out since then
    last_probe: float = float("-inf")
    usage: list[float] = field(default_factory=list)
    peak_inflight: int = 0  # turns sent and not back, at most
    peak_waiting: int = 0  # of those, waiting inside the engine (vLLM's queue: no KV or no seat), at most
    preemptions: tuple[int, int] | None = None  # (first seen, last seen): cumulative counters

    def turn_sent(self, now: float) -> None:
        if not self.inflight:
            self.busy_since, self.progress_at = now, now
        self.inflight += 1
        self.peak_inflight = max(self.peak_inflight, self.inflight)

    def turn_back(self, now: float) -> None:
        self.inflight -= 1
        self.progress_at = now
        if not self.inflight:
            self.busy_s += now - self.busy_since
            self.busy_since = None

    def stats(self, s: dict, now: float) -> None:
        self.usage.append(float(s["kv_usage"]))
        self.peak_waiting = max(self.peak_waiting, int(s.get("waiting", 0)))
        p = int(s["preemptions"])
        self.preemptions = (p, p) if self.preemptions is None else (self.preemptions[0], max(p, self.preemptions[1]))
        if "steps" in s and s["steps"] != self.steps:
            self.steps, self.progress_at = s["steps"], now

    def died(self, now: float) -> None:
        self.stop(now)
        self.alive, self.inflight, self.probe_sent = False, 0, None

    def stop(self, now: float) -> None:
        if self.busy_since is not None:
            self.busy_s += now - self.busy_since
            self.busy_since = None


class AgentLoop:
    """Roll out `n_samples` trajectories per problem on `engines` (see the module docstring). engines.clients[e]
    takes one trajectory-turn at a time and batches whatever is in flight; engines.capacities[e] is its KV capacity
    in tokens. `estimator`: kv_aware's length model, carried over from earlier rollouts (it learns from their
    finished trajectories); None starts from a prior. `on_done(finished, total)` after each finished trajectory."""

    def __init__(self, engines: EngineSet, cfg: SchedulerCfg, sandbox: Sandbox, chat: ChatFormat, limits: RolloutLimits,
                 policy: str | None = None, estimator: LengthEstimator | None = None,
                 on_done: Callable[[int, int], None] | None = None):
        self.clients, self.capacities = engines
        self.cfg, self.sandbox, self.chat, self.limits = cfg, sandbox, chat, limits
        self.policy, self.estimator, self.on_done = policy, estimator, on_done

    def run(self, problems: list[dict], n_samples: int, seed: int | str | None = None, version: int = 0,
            carried: list[Trajectory] = (), quota: int | None = None) -> tuple[list[Trajectory], dict]:
        """The trajectories (problem by problem, sample by sample) and the rollout's scheduling metrics (per engine:
        busy share, KV usage mean/max, preemptions, peaks; queue wait, tool wait, requeues, engine failures). With
        `seed`, each turn samples from its own seed (Trajectory.turn_seed): the same trajectories whatever the
        policy, placement or timing. Every turn records `version`, the policy's.

        With `quota` (a partial rollout): the `carried` trajectories (whole groups, a problem's consecutively) come
        first, and the rollout ends once the cut (`self.cut`) is settled; the trajectories are returned as they
        stand then, carried ones first."""
        self.version = version
        self.trajs = list(carried) + make_trajs(self.chat, problems, n_samples, self.limits, seed)
        self.cut = None if quota is None else Cut(_groups(self.trajs), len(_groups(list(carried))), quota)
        block = max(getattr(c, "block_size", 1) for c in self.clients)
        self.session = SchedulerSession(Scheduler(self.capacities, self.cfg, self.policy, self.estimator, block))
        for i, t in enumerate(self.trajs):
            if t.done:  # carried, and ended before the cut
                self.cut.ended(i)
                continue
            self.session.submit(i, t.problem_id, len(t.prompt_ids), t.budget, 0.0, None, len(t.response_ids),
                                t.num_turns)
        self.t0 = time.perf_counter()
        self.watch = [EngineWatch() for _ in self.clients]
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.failures: list[dict] = []
        self.tool_waits: list[float] = []
        self.tools_out: set[Future] = set()  # tool calls in the sandbox
        self.finished = 0
        first = self._probe_all()  # stats before the rollout (the preemption baseline); no answer = dead
        wait(first, timeout=self.cfg.hang_timeout_s)
        while not (self.cut.settled if self.cut else self.session.done):
            self._place()
            for c in self.clients:  # the turns placed now and those the last events sent on
                c.flush()
            self._probe_all()
            if not self.tools_out and not any(w.inflight for w in self.watch):
                raise RuntimeError("rollout stalled: trajectories left but nothing running (a scheduler bug)")
            for ev in self._next_events(self.cfg.probe_interval_s):
                self._handle(ev)
            self._check_hangs()
        if self.cut:
            self._abort_rest()
        return self.trajs, self._metrics()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    # ---- sending --------------------------------------------------------------------------------------------
    def _place(self) -> None:
        """Send the turns of every trajectory placed now; a send that fails kills its engine, whose trajectories
        are requeued: place again until none fails."""
        failed = -1
        while failed != len(self.failures):
            failed = len(self.failures)
            for tid, e in self.session.placements(self.now()):
                self._send(tid, e)

    def _send(self, tid: int, e: int) -> None:
        if self.session.engine_of(tid) != e:  # its engine failed while this batch of placements was being sent
            return
        t = self.trajs[tid]
        try:
            f = self.clients[e].submit(t.prompt_ids + t.response_ids, t.budget - len(t.response_ids), t.turn_seed(),
                                       self.session.priority(tid))
        except Exception as err:  # noqa: BLE001 - a dead engine: requeue, the batch completes
            return self._fail(e, repr(err))
        self.watch[e].turn_sent(self.now())
        f.add_done_callback(lambda f: self.events.put(_turn_event(e, tid, f)))

    def _call_tool(self, tid: int, p: Pending) -> None:
        """The call goes to the sandbox at once; a full sandbox queue holds this thread until it has room."""
        sent = self.now()
        f = self.sandbox.submit(p.request)
        self.tools_out.add(f)
        f.add_done_callback(lambda f: self.events.put(ToolDone(tid, p, f, sent)))

    def _probe_all(self) -> list[Future]:
        out = []
        for e, w in enumerate(self.watch):
            if w.alive and w.probe_sent is None and self.now() - w.last_probe >= self.cfg.probe_interval_s:
                try:
                    f = self.clients[e].probe()
                except Exception as err:  # noqa: BLE001
                    self._fail(e, repr(err))
                    continue
                w.probe_sent = w.last_probe = self.now()
                f.add_done_callback(lambda f, e=e: self.events.put(_probe_event(e, f)))
                out.append(f)
        return out

    # ---- events ---------------------------------------------------------------------------------------------
    def _next_events(self, timeout: float) -> list:
        """The events since the last call (waiting up to `timeout` for a first one)."""
        try:
            out = [self.events.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                out.append(self.events.get_nowait())
            except queue.Empty:
                return out

    def _handle(self, ev) -> None:
        if isinstance(ev, ToolDone):
            return self._on_tool(ev)
        if not self.watch[ev.engine].alive:
            return  # from an engine declared dead: its trajectories run elsewhere now
        if isinstance(ev, TurnDone):
            self._on_turn(ev)
        elif isinstance(ev, Probed):
            self.watch[ev.engine].probe_sent = None
            self.watch[ev.engine].stats(ev.stats, self.now())
            self.session.probed(ev.engine, self.now(), float(ev.stats["kv_usage"]), int(ev.stats["preemptions"]))
        else:
            self._fail(ev.engine, ev.error)

    def _on_turn(self, ev: TurnDone) -> None:
        t, w, now = self.trajs[ev.tid], self.watch[ev.engine], self.now()
        w.turn_back(now)
        w.stats(ev.stats, now)
        p = model_turn(t, ev.ids, ev.finish, self.chat, self.limits, ev.logprobs, self.version)
        if self.cut:
            self.cut.progress(ev.tid, _clock(t))
        if p is None:
            then = END
        elif self.cut and self.cut.holds(ev.tid):
            then = CUT
        elif p.request is not None:
            then = TOOL
        else:  # a reply known without running code (a broken call)
            then = TURN if tool_turn(p, self.chat) else END
        stats = (float(ev.stats["kv_usage"]), int(ev.stats["preemptions"]))
        if self.session.turn_done(ev.tid, ev.engine, now, len(t.response_ids), t.num_turns, then, stats):
            self._send(ev.tid, ev.engine)
        elif then == TOOL:
            self._call_tool(ev.tid, p)
        elif then == END:
            self._ended(ev.tid)

    def _on_tool(self, ev: ToolDone) -> None:
        self.tools_out.discard(ev.future)
        t, now = self.trajs[ev.tid], self.now()
        self.tool_waits.append(now - ev.sent_at)
        result = ev.future.result()
        if self.cut and self.cut.holds(ev.tid):  # the cut passed it meanwhile: this turn is not kept
            return self.session.cut(ev.tid, now)
        tool_result(ev.pending, result, self.limits)
        fits = tool_turn(ev.pending, self.chat)
        if self.session.tool_done(ev.tid, now, len(t.response_ids), t.num_turns, ended=not fits):
            self._send(ev.tid, self.session.engine_of(ev.tid))
        elif not fits:
            self._ended(ev.tid)

    def _ended(self, tid: int) -> None:
        self.finished += 1
        if self.cut:
            self.cut.ended(tid)
        if self.on_done:
            self.on_done(self.finished, len(self.trajs))

    def _abort_rest(self) -> None:
        """The cut is settled: the turns still out are not needed (nor their tool calls: those the sandbox has not
        started are dropped, those running finish there unread)."""
        for c in self.clients:
            c.cancel()
        for f in self.tools_out:
            f.cancel()

    # ---- failures -------------------------------------------------------------------------------------------
    def _fail(self, e: int, why: str) -> None:
        self.failures.append({"engine": e, "at_s": round(self.now(), 3), "error": why[:200]})
        self.watch[e].died(self.now())
        self.session.engine_failed(e, self.now())

    def _check_hangs(self) -> None:
        now, limit = self.now(), self.cfg.hang_timeout_s
        for e, w in enumerate(self.watch):
            if not w.alive:
                continue
            if w.probe_sent is not None and now - w.probe_sent > limit:
                self._fail(e, f"hang: no answer to a probe for {limit} s")
            elif w.inflight and now - w.progress_at > limit:
                self._fail(e, f"hang: {w.inflight} turns in flight and no progress for {limit} s")

    # ---- figures --------------------------------------------------------------------------------------------
    def _metrics(self) -> dict:
        wall = self.now()
        summ = self.session.finish()
        per_engine: dict = {}
        for e, w in enumerate(self.watch):
            w.stop(wall)
            pre = w.preemptions[1] - w.preemptions[0] if w.preemptions else 0
            per_engine.update({f"sched_engine{e}_busy": w.busy_s / max(wall, 1e-9),
                               f"sched_engine{e}_dispatched": summ["dispatched_per_engine"][e],
                               f"sched_engine{e}_kv_usage_mean": float(np.mean(w.usage)) if w.usage else 0.0,
                               f"sched_engine{e}_kv_usage_max": max(w.usage, default=0.0),
                               f"sched_engine{e}_preemptions": pre,
                               f"sched_engine{e}_peak_inflight": w.peak_inflight,
                               f"sched_engine{e}_peak_waiting": w.peak_waiting})
        waits = self.tool_waits
        return {"rollout_wall_s": wall, "sched_policy": summ["policy"],
                "sched_queue_wait_mean_s": summ["queue_wait_mean_s"],
                "sched_queue_wait_p95_s": summ["queue_wait_p95_s"],
                "sched_requeued": summ["requeued"], "sched_engine_failures": len(self.failures),
                "sched_tool_wait_s": float(sum(waits)),
                "sched_tool_wait_mean_s": float(np.mean(waits)) if waits else 0.0,
                "sched_preemptions": sum(v for k, v in per_engine.items() if k.endswith("_preemptions")),
                "sched_failures": self.failures, **per_engine}
