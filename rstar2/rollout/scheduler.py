"""Which engine runs which trajectory, and when (paper §3.2 "load-balanced rollout scheduler";
bench/rollout_sim.py compares the policies at the paper's scale).

Pure logic: no clock, no I/O, no asyncio. `Scheduler` keeps the books: each engine's KV capacity, expected load and
vLLM's last stats, each trajectory's state. Its policy (rstar2.rollout.policies, by SchedulerCfg.policy) owns the queue
and decides placement: it reads the books through a read-only `PolicyView` and returns its decisions (placements, the
admission margin, an engine's new factor), which the scheduler applies. `SchedulerSession` is the protocol, in the one
order that both the agent loop (rstar2.rollout.agent_loop) and the simulator (rstar2.bench.rollout_sim) follow:

    submit(...) every trajectory  ->  placements(now): which queued ones start on which engine, to be sent now
    turn_done(...) as each turn ends (with the engine's stats), tool_done(...) as each tool reply comes in
    probed(...) with an engine's stats between turns; engine_failed(e) when an engine dies or hangs: its
    trajectories go back to the front of the queue and resume from their last completed turn elsewhere

Every policy is sticky: all turns of a trajectory run on the engine that started it (its KV prefix is cached
there), until it is released or its engine fails.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from rstar2.core.config import SchedulerCfg
from rstar2.rollout.estimator import LengthEstimator
from rstar2.rollout.policies import POLICIES, Margin, Policy, Refused

QUEUED, RUNNING, DONE = "queued", "running", "done"
OUTCOMES = ("finished", "error", "cancel")


class SchedulerError(RuntimeError):
    """A caller broke the protocol (e.g. released a trajectory twice): a bug, never silently ignored."""


@dataclass
class TrajView:
    """What the scheduler knows of one trajectory."""
    tid: int
    group: str
    prompt_len: int
    budget: int  # response tokens allowed
    submitted_at: float
    known_len: int | None = None  # oracle policies only: the final response length
    state: str = QUEUED
    engine: int | None = None
    response_len: int = 0
    turns: int = 0
    footprint: np.ndarray | None = None  # expected response KV over the coming tokens (kv_aware, oracle)
    queued_at: float = 0.0
    queue_wait_s: float = 0.0
    requeues: int = 0
    rank: int | None = None  # start order: kv_aware's vLLM priority for every turn
    away_kv: float | None = None  # at a tool: its KV now (vLLM holds it only as evictable cache); None: in a turn
    outcome: str | None = None


@dataclass
class EngineView:
    """What the scheduler knows of one engine: KV capacity (tokens), expected load, and vLLM's last stats."""
    capacity: int
    factor: float
    load: np.ndarray  # sum of in-flight footprints: mean and variance over the coming tokens, shape [2, POINTS]
    z: float = 0.0  # the peak counts z standard deviations over the mean (lengths are random)
    slack: float = 0.0  # admission may go this share over the budget (the queue's tail, see KvAware.margin)
    alive: bool = True
    prompts: float = 0.0  # prompts of the groups in flight here, once each (shared through the prefix cache)
    inflight: set[int] = field(default_factory=set)
    groups: dict[str, int] = field(default_factory=dict)  # group -> trajectories of it in flight here
    usage: float = 0.0  # fraction of KV blocks in use, as vLLM reports it
    lag: float = 0.0  # KV in use beyond what the footprints account for now (tokens generated since the last turn)
    away: float = 0.0  # KV now of the trajectories at a tool, which vLLM's usage does not count (evictable cache),
    # and the shared prompt of each group all of whose trajectories here are at a tool
    away_members: dict[str, int] = field(default_factory=dict)  # group -> its trajectories here at a tool
    away_groups: set[str] = field(default_factory=set)  # groups whose prompt counts in `away`
    preemptions_seen: int | None = None  # vLLM's cumulative count at the last report (None: no report yet)
    blocked: bool = False  # admission refused for lack of room since the last adaptation
    last_adapt: float = float("-inf")
    dispatched: int = 0

    @property
    def budget(self) -> float:
        return self.factor * self.capacity * (1 + self.slack)

    @property
    def peak(self) -> float:
        """Expected peak KV of what runs here (the max over the coming tokens of the summed footprints)."""
        return float(_upper(self.load, self.z).max()) + self.prompts + self.lag


def _upper(load: np.ndarray, z: float) -> np.ndarray:
    """Mean + z standard deviations of summed footprints: load [..., 2, POINTS] (mean, variance) -> [..., POINTS]."""
    return load[..., 0, :] + z * np.sqrt(np.maximum(load[..., 1, :], 0))


def _read_only(a: np.ndarray) -> np.ndarray:
    """A view of a that cannot be written through."""
    v = a.view()
    v.flags.writeable = False
    return v


@dataclass(frozen=True)
class EngineState:
    """One engine's admission state as a policy sees it (a copy)."""
    capacity: int
    factor: float
    blocked: bool
    last_adapt: float
    peak: float  # EngineView.peak


class PolicyView:
    """What a policy sees of its scheduler's books, read-only: arrays that cannot be written through, trajectories
    by id in a read-only mapping. It is live: during `pick`, each question sees the placements applied so far."""

    __slots__ = ("_s", "_trajs", "_alive", "_inflight", "_admit", "_outside", "_load_mean")

    def __init__(self, s: Scheduler):
        self._s = s
        self._trajs = MappingProxyType(s.trajs)
        self._alive, self._inflight = _read_only(s._alive), _read_only(s._inflight)
        self._admit, self._outside = _read_only(s._full), _read_only(s._held)
        self._load_mean = _read_only(s._loads[:, 0])

    @property
    def cfg(self) -> SchedulerCfg:
        return self._s.cfg

    @property
    def estimator(self) -> LengthEstimator:
        return self._s.estimator

    @property
    def block_size(self) -> int:
        return self._s.block_size

    @property
    def grid(self) -> np.ndarray | None:
        """The footprints' h grid [POINTS] (None before the first dispatch)."""
        return self._s.grid

    @property
    def trajs(self) -> Mapping[int, TrajView]:
        return self._trajs

    @property
    def alive(self) -> np.ndarray:
        """Per engine [E]: takes work (bool)."""
        return self._alive

    @property
    def inflight(self) -> np.ndarray:
        """Per engine [E]: trajectories placed there and not released."""
        return self._inflight

    @property
    def admit_kv(self) -> np.ndarray:
        """Per engine [E]: factor x KV capacity, what admission may fill before any slack."""
        return self._admit

    @property
    def outside_kv(self) -> np.ndarray:
        """Per engine [E]: KV held outside the footprints (shared prompts, and the lag behind vLLM's usage)."""
        return self._outside

    @property
    def load_mean(self) -> np.ndarray:
        """Per engine [E, POINTS]: the in-flight footprints' summed mean over the coming tokens."""
        return self._load_mean

    def rooms(self, tv: TrajView, fp: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Scheduler.rooms, read-only."""
        rooms, fits = self._s.rooms(tv, fp)
        rooms.flags.writeable = fits.flags.writeable = False
        return rooms, fits

    def shared_prompt(self, tv: TrajView) -> int:
        return self._s.shared_prompt(tv)

    def engine(self, e: int) -> EngineState:
        v = self._s.engines[e]
        return EngineState(v.capacity, v.factor, v.blocked, v.last_adapt, v.peak)


class Scheduler:
    def __init__(self, capacities: list[int], cfg: SchedulerCfg, policy: str | type[Policy] | None = None,
                 estimator: LengthEstimator | None = None, block_size: int = 1):
        """capacities: KV tokens per engine; policy: a name in rstar2.rollout.policies.POLICIES (default cfg.policy) or
        a Policy class (the simulator's oracles); block_size: vLLM's KV block (tokens are allocated in whole blocks: 16
        on GPUs, 128 on CPU, where a tiny trajectory holds one block for ~120 tokens)."""
        policy = policy or cfg.policy
        if isinstance(policy, str):
            if policy not in POLICIES:
                raise ValueError(f"unknown scheduling policy {policy!r}; choose from {', '.join(POLICIES)}")
            policy = POLICIES[policy]
        if not capacities or min(capacities) <= 0:
            raise ValueError(f"every engine needs a positive KV capacity in tokens, got {capacities}")
        self.cfg = cfg
        self.block_size = max(1, int(block_size))
        self.estimator = estimator or LengthEstimator(cfg.estimator_window, cfg.prior_frac)
        n = len(capacities)
        self._loads = np.zeros((n, 2, LengthEstimator.POINTS))  # engine e's load is row e (a view)
        # per-engine mirrors of the views, so placement is a few vector operations (a paper-scale simulated step
        # places 16K trajectories on 64 engines): budget - prompts - lag, open for one more, idle
        self._base, self._can_take, self._idle = np.zeros(n), np.ones(n, bool), np.ones(n, bool)
        self._held, self._full = np.zeros(n), np.zeros(n)  # prompts + lag; factor x capacity
        self._alive, self._inflight = np.ones(n, bool), np.zeros(n, np.int64)  # alive; trajectories in flight
        self._siblings: dict[str, np.ndarray] = {}  # group -> its trajectories in flight per engine
        self.trajs: dict[int, TrajView] = {}
        self.grid: np.ndarray | None = None  # the footprints' h grid, fixed at the first dispatch
        self.policy = policy(PolicyView(self))
        factor = cfg.oversubscribe if self.policy.oversubscribes else 1.0
        self.engines = [EngineView(int(c), factor, self._loads[e], z=self.policy.z) for e, c in enumerate(capacities)]
        for e in range(n):
            self._sync(e)
        self._starts = 0
        self._done = 0

    @property
    def uses_priority(self) -> bool:
        """Whether engines should run vLLM's priority scheduling, with `priority(tid)` on every turn."""
        return self.policy.uses_priority

    def priority(self, tid: int) -> int:
        """vLLM priority of tid's turns (lower runs first and is preempted last): the trajectory's start order.
        vLLM's default (FCFS) orders by *turn* arrival, so a trajectory back from a tool call, holding the most KV,
        is the newest and the first preempted; by start order an overflow preempts the trajectory started last,
        whose context is the shortest (simulated, stage 1 with tight KV: 1.86 % of decoded tokens recomputed, FCFS
        2.015 %)."""
        tv = self.trajs[tid]
        return tv.rank if self.uses_priority and tv.rank is not None else 0

    # ---- trajectories in ------------------------------------------------------------------------------------
    def submit(self, tid: int, group: str, prompt_len: int, budget: int, now: float,
               known_len: int | None = None) -> None:
        if tid in self.trajs:
            raise SchedulerError(f"trajectory {tid} submitted twice")
        if budget <= 0:
            raise ValueError(f"trajectory {tid}: the response budget must be positive, got {budget}")
        if self.policy.needs_lengths and known_len is None:
            raise ValueError(f"policy {self.policy.name} needs every trajectory's final length (simulation only)")
        self.trajs[tid] = TrajView(tid, group, prompt_len, budget, now, known_len, queued_at=now)
        self.policy.push(self.trajs[tid])

    # ---- placement ------------------------------------------------------------------------------------------
    def dispatch(self, now: float) -> list[tuple[int, int]]:
        """(trajectory, engine) pairs to start now, in order: the policy's margin and picks, applied one by one."""
        if not any(e.alive for e in self.engines):
            if self.queued:
                raise SchedulerError("no engine left alive, trajectories are still queued")
            return []
        if not self.queued:
            return []
        if self.grid is None:
            self.grid = self.estimator.grid(max((t.budget for t in self.trajs.values()), default=1))
            self.grid.flags.writeable = False
        margin = self.policy.margin()
        if margin is not None:
            self._set_margin(margin)
        picks = []
        for d in self.policy.pick():
            if isinstance(d, Refused):
                for e in d.engines:
                    self.engines[e].blocked = True
                continue
            tv = self.trajs[d.tid]
            self._place(tv, d.engine, d.footprint)
            tv.queue_wait_s += now - tv.queued_at
            picks.append((d.tid, d.engine))
        return picks

    def _set_margin(self, m: Margin) -> None:
        """Every engine's admission margin, as the policy decided for this dispatch."""
        for e, v in enumerate(self.engines):
            if (v.z, v.slack) != (m.z, m.slack):
                v.z, v.slack = m.z, m.slack
                self._sync(e)

    def rooms(self, tv: TrajView, fp: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Per engine: budget left over the coming tokens if tv (footprint fp) starts there (-inf where it cannot
        start: dead or at max_inflight), and whether it fits (an idle engine takes anything: a footprint larger
        than a whole budget must not deadlock)."""
        z = self.engines[0].z
        sib, shared = self._siblings.get(tv.group), self.shared_prompt(tv)
        charge = shared if sib is None else np.where(sib > 0, 0, shared)
        upper = _upper(self._loads + fp[None], z) if z else self._loads[:, 0] + fp[0]  # [E, POINTS]
        rooms = np.where(self._can_take, self._base - charge - upper.max(axis=1), -np.inf)  # [E]
        return rooms, self._can_take & ((rooms >= 0) | self._idle)

    def _sync(self, e: int) -> None:
        """Refresh engine e's entries in the placement vectors after its view changed."""
        v = self.engines[e]
        self._held[e], self._full[e] = v.prompts + v.lag, v.factor * v.capacity
        self._base[e] = v.budget - v.prompts - v.lag
        self._can_take[e] = v.alive and len(v.inflight) < self.cfg.max_inflight
        self._idle[e] = not v.inflight
        self._alive[e], self._inflight[e] = v.alive, len(v.inflight)

    def shared_prompt(self, tv: TrajView) -> int:
        """The prompt KV all rollouts of a prompt on one engine share (vLLM's prefix cache shares whole blocks):
        charged once per engine; the partial last block is each trajectory's own, in its footprint."""
        return tv.prompt_len // self.block_size * self.block_size

    def _place(self, tv: TrajView, e: int, fp: np.ndarray | None = None) -> None:
        """Start queued tv on engine e (a policy's pick), with its footprint fp if already computed."""
        if tv.state != QUEUED:
            raise SchedulerError(f"trajectory {tv.tid} is {tv.state}, cannot start")
        v = self.engines[e]
        tv.state, tv.engine = RUNNING, e
        tv.footprint = fp if fp is not None else self.policy.footprint(tv)
        if tv.footprint is not None:
            v.load += tv.footprint
        v.prompts += 0 if v.groups.get(tv.group) else self.shared_prompt(tv)
        v.groups[tv.group] = v.groups.get(tv.group, 0) + 1
        self._prompt_away(v, tv)  # a new one is in a turn: its group's prompt is in vLLM's KV
        v.inflight.add(tv.tid)
        self._siblings.setdefault(tv.group, np.zeros(len(self.engines)))[e] += 1
        self._sync(e)
        v.dispatched += 1
        if tv.rank is None:  # kept when requeued after an engine failure
            tv.rank, self._starts = self._starts, self._starts + 1
        if not tv.requeues:
            self.policy.started(tv)

    # ---- progress and stats ---------------------------------------------------------------------------------
    def progress(self, tid: int, response_len: int, turns: int) -> None:
        """After a turn or a tool reply: the trajectory's response so far (tool tokens included) and its turns;
        re-estimates (also while it is queued again after its engine failed: its next placement counts them)."""
        tv = self.trajs.get(tid)
        if tv is None or tv.state == DONE:
            raise SchedulerError(f"trajectory {tid} is not in flight ({tv.state if tv else 'unknown'})")
        self.policy.grew(tv, response_len - tv.response_len)
        tv.response_len, tv.turns = response_len, turns
        if tv.footprint is not None:
            v = self.engines[tv.engine]
            new = self.policy.footprint(tv)
            v.load += new - tv.footprint
            tv.footprint = new

    def at_tool(self, tid: int, away: bool) -> None:
        """The trajectory's turn ended in a tool call (away) or its next turn goes in (not away). While it is away,
        vLLM keeps its KV only as evictable prefix cache, which vLLM's KV usage counts as free: the lag (KV in use
        beyond the footprints) compares vLLM's usage with the trajectories in a turn only. Its footprint still
        counts for admission: its next turn comes back to this engine (sticky), and its cached prefix with it."""
        tv = self._running(tid)
        if (tv.away_kv is not None) == away:
            return
        v = self.engines[tv.engine]
        if away:
            tv.away_kv = float(tv.footprint[0, 0]) if tv.footprint is not None else 0.0
            v.away += tv.away_kv
        else:
            v.away -= tv.away_kv
            tv.away_kv = None
        v.away_members[tv.group] = v.away_members.get(tv.group, 0) + (1 if away else -1)
        self._prompt_away(v, tv)

    def _prompt_away(self, v: EngineView, tv: TrajView) -> None:
        """Count tv's group's shared prompt in `away` exactly while all of the group's trajectories here are away."""
        g = tv.group
        all_away = v.groups.get(g, 0) > 0 and v.away_members.get(g, 0) == v.groups[g]
        if all_away != (g in v.away_groups):
            (v.away_groups.add if all_away else v.away_groups.discard)(g)
            v.away += self.shared_prompt(tv) if all_away else -self.shared_prompt(tv)

    def observe_engine(self, e: int, now: float, usage: float, preemptions_total: int) -> None:
        """vLLM's own stats for engine e: KV usage (fraction of blocks in use) and cumulative preemptions; the policy
        may adapt the engine's budget (kv_aware)."""
        v = self.engines[e]
        v.usage = usage
        v.lag = max(0.0, usage * v.capacity - (float(v.load[0, 0]) - v.away) - v.prompts)
        self._sync(e)
        # vLLM counts preemptions over the engine's life (engines outlive RL steps): the first report is a baseline
        preempted = v.preemptions_seen is not None and preemptions_total > v.preemptions_seen
        v.preemptions_seen = max(v.preemptions_seen or 0, preemptions_total)
        factor = self.policy.adapt(e, now, usage, preempted)
        if factor is not None:
            v.factor, v.blocked, v.last_adapt = factor, False, now
            self._sync(e)

    # ---- trajectories out -----------------------------------------------------------------------------------
    def release(self, tid: int, outcome: str, now: float) -> None:
        """A trajectory ends: finished, error (its own) or cancel. Exactly once; a second release is a bug."""
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {OUTCOMES}, got {outcome!r}")
        tv = self.trajs.get(tid)
        if tv is None:
            raise SchedulerError(f"trajectory {tid} was never submitted")
        if tv.state == DONE:
            raise SchedulerError(f"trajectory {tid} released twice (was {tv.outcome}, now {outcome})")
        if tv.state == RUNNING:
            self._unplace(tv)
        else:
            self.policy.remove(tv)
        tv.state, tv.outcome = DONE, outcome
        self._done += 1
        if outcome == "finished":
            self.estimator.observe(tv.response_len, tv.turns)

    def engine_failed(self, e: int, now: float) -> list[int]:
        """Engine e died or hangs: it takes no more work, and its trajectories go back to the front of the queue
        (they resume from their last completed turn on another engine). Returns them."""
        v = self.engines[e]
        v.alive = False
        self._sync(e)
        back = sorted(v.inflight)
        for tid in reversed(back):
            tv = self.trajs[tid]
            self._unplace(tv)
            tv.state, tv.queued_at, tv.requeues = QUEUED, now, tv.requeues + 1
            self.policy.requeue(tv)
        if not any(w.alive for w in self.engines) and back:
            raise SchedulerError(f"engine {e} failed and no engine is left for its {len(back)} trajectories")
        return back

    def _unplace(self, tv: TrajView) -> None:
        v = self.engines[tv.engine]
        v.inflight.discard(tv.tid)
        self._siblings[tv.group][tv.engine] -= 1
        v.groups[tv.group] -= 1
        if not v.groups[tv.group]:
            del v.groups[tv.group]
            v.prompts -= self.shared_prompt(tv)
        if tv.footprint is not None:
            v.load -= tv.footprint
        if tv.away_kv is not None:
            v.away -= tv.away_kv
            v.away_members[tv.group] -= 1
            tv.away_kv = None
        self._prompt_away(v, tv)
        if not v.inflight:  # no float drift on an empty engine
            v.load[:] = 0.0
            v.prompts = v.away = 0.0
            v.away_members.clear()
            v.away_groups.clear()
        self._sync(tv.engine)
        tv.footprint, tv.engine = None, None

    def _running(self, tid: int) -> TrajView:
        tv = self.trajs.get(tid)
        if tv is None or tv.state != RUNNING:
            raise SchedulerError(f"trajectory {tid} is not running ({tv.state if tv else 'unknown'})")
        return tv

    # ---- summaries ------------------------------------------------------------------------------------------
    @property
    def queued(self) -> int:
        return len(self.policy)

    @property
    def done(self) -> bool:
        return self._done == len(self.trajs)

    def summary(self) -> dict:
        waits = np.array([t.queue_wait_s for t in self.trajs.values()]) if self.trajs else np.zeros(1)
        return {"policy": self.policy.name, "queue_wait_mean_s": float(waits.mean()),
                "queue_wait_p95_s": float(np.quantile(waits, 0.95)),
                "requeued": int(sum(t.requeues for t in self.trajs.values())),
                "dispatched_per_engine": [v.dispatched for v in self.engines],
                "factor_final": [round(v.factor, 3) for v in self.engines],
                "estimator_samples": self.estimator.samples}


# what follows a turn (SchedulerSession.turn_done)
TOOL, TURN, END = "tool", "turn", "end"  # waits on the sandbox | its next turn goes in now | it has ended
CUT = "cut"  # it takes no more turns in this rollout (a partial rollout's cut passed it: rstar2.rollout.partial)


class SchedulerSession:
    """One rollout's protocol with a Scheduler, in the single order that the agent loop and the simulator both
    follow (neither calls the Scheduler itself):

        submit every trajectory -> placements(now) -> send each placed trajectory's turn to its engine
        a turn comes back       -> turn_done(...): its length, then TOOL / TURN / END, with the engine's stats
        a tool reply comes in   -> tool_done(...): its length (or it ended: the reply did not fit)
        an engine's stats       -> probed(...);  an engine dies or hangs -> engine_failed(e)
        until `done`; then finish() commits what the length estimate learned and gives the summary.

    The order inside each event matters to kv_aware: a turn's length is reported before its trajectory leaves for a
    tool (its footprint then holds the turn vLLM keeps cached), and the trajectory is away before the engine's stats
    are read (vLLM's usage no longer counts its KV). A trajectory requeued while at a tool is placed but not sent:
    it is away on its new engine until its reply is in."""

    def __init__(self, sched: Scheduler):
        self.sched = sched
        self._away: set[int] = set()  # waiting on the sandbox (their next turn goes in once the reply is in)

    def submit(self, tid: int, group: str, prompt_len: int, budget: int, now: float,
               known_len: int | None = None, response_len: int = 0, turns: int = 0) -> None:
        """A trajectory to roll out; one carried from an earlier rollout comes with its response so far (its
        length and turns), which its length estimate and KV footprint start from."""
        self.sched.submit(tid, group, prompt_len, budget, now, known_len)
        if response_len or turns:
            self.sched.progress(tid, response_len, turns)

    def placements(self, now: float) -> list[tuple[int, int]]:
        """(trajectory, engine) pairs whose next turn goes to that engine now."""
        out = []
        for tid, e in self.sched.dispatch(now):
            if tid in self._away:
                self.sched.at_tool(tid, True)
            else:
                out.append((tid, e))
        return out

    def turn_done(self, tid: int, e: int, now: float, response_len: int, turns: int, then: str,
                  stats: tuple[float, int] | None = None) -> bool:
        """A turn of tid came back from engine e: its response length so far (a reply known without running code
        included) and turns, what follows (TOOL, TURN or END), and the engine's (KV usage, preemptions) with it.
        True: its next turn goes in now."""
        s = self.sched
        s.progress(tid, response_len, turns)
        if then == TOOL:
            s.at_tool(tid, True)
            self._away.add(tid)
        if stats is not None:
            s.observe_engine(e, now, *stats)
        if then == END:
            s.release(tid, "finished", now)
        elif then == CUT:
            s.release(tid, "cancel", now)
        return then == TURN

    def cut(self, tid: int, now: float) -> None:
        """tid, back from a tool call, takes no more turns (a partial rollout's cut passed it)."""
        self._away.discard(tid)
        self.sched.release(tid, "cancel", now)

    def tool_done(self, tid: int, now: float, response_len: int, turns: int, ended: bool) -> bool:
        """tid's tool reply is in: appended (its length so far), or it did not fit and tid ended. True: its next turn
        goes in now (False while it waits in the queue after its engine failed: placements() sends it later)."""
        s = self.sched
        self._away.discard(tid)
        running = s.trajs[tid].state == RUNNING
        s.progress(tid, response_len, turns)
        if ended:
            s.release(tid, "finished", now)
            return False
        if running:
            s.at_tool(tid, False)
        return running

    def probed(self, e: int, now: float, usage: float, preemptions_total: int) -> None:
        self.sched.observe_engine(e, now, usage, preemptions_total)

    def engine_failed(self, e: int, now: float) -> list[int]:
        return self.sched.engine_failed(e, now)

    def engine_of(self, tid: int) -> int | None:
        """The engine tid runs on, None while it is queued or done."""
        tv = self.sched.trajs[tid]
        return tv.engine if tv.state == RUNNING else None

    def priority(self, tid: int) -> int:
        return self.sched.priority(tid)

    @property
    def uses_priority(self) -> bool:
        return self.sched.uses_priority

    @property
    def done(self) -> bool:
        return self.sched.done

    def finish(self) -> dict:
        """The rollout is over: the finished trajectories join the length estimate's reference; the summary."""
        self.sched.estimator.commit()
        return self.sched.summary()
