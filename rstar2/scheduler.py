"""Which engine runs which trajectory, and when (paper §3.2 "load-balanced rollout scheduler"; implementation
notes §7; the planning report shared/reference/scheduler-simulation.md).

Pure logic: no clock, no I/O, no asyncio. The agent loop (rstar2.rollout) and the simulator (rstar2.rollout_sim)
drive the same `Scheduler`:

    submit(...) every trajectory  ->  dispatch(now) says which queued ones start on which engine
    progress(...) after each turn  ->  observe_engine(...) with the engine's own KV stats (vLLM's)
    release(..., outcome) exactly once per trajectory (finished, error or cancel)
    engine_failed(e) when an engine dies or hangs: its trajectories go back to the front of the queue

Policies:
  static          the common default (verl): a prompt's rollouts together, prompts split into contiguous blocks of
                  engines, everything sent at t=0 (the engine queues and preempts on its own)
  round_robin     trajectory i -> engine i mod E at t=0 (a prompt's rollouts spread over engines)
  least_requests  late binding from a global queue to the engine with the fewest in flight, up to max_inflight
  kv_aware        late binding by KV tokens: each trajectory reserves its *expected* footprint (context so far +
                  expected remaining response, learned from finished trajectories given its length and turn count),
                  an engine admits while its reservations fit factor x its KV capacity, the factor adapts to the
                  engine's measured KV usage and preemptions, and the queue head goes to the most headroom
  oracle          (simulation only) clairvoyant late binding: longest true length first, admitted while the
                  engine's true future KV (every length known) fits its KV capacity
  oracle_static   (simulation only) clairvoyant early binding: longest-processing-time-first balance at t=0

Every policy is sticky: all turns of a trajectory run on the engine that started it (its KV prefix is cached
there), until it is released or its engine fails.
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from rstar2.config import SchedulerCfg

POLICIES = ("static", "round_robin", "least_requests", "kv_aware", "oracle", "oracle_static")
LATE_BINDING = ("least_requests", "kv_aware", "oracle")
QUEUED, RUNNING, DONE = "queued", "running", "done"
OUTCOMES = ("finished", "error", "cancel")


class SchedulerError(RuntimeError):
    """A caller broke the protocol (e.g. released a trajectory twice): a bug, never silently ignored."""


class LengthEstimator:
    """How much KV a running trajectory is expected to hold as it goes on, from recently finished ones.

    A trajectory at response length l after k turns holds l + h tokens after h more of its tokens if it is still
    running then, and nothing once it has ended (its KV is freed). Its expected footprint over the next h tokens:
        G(h) = (l + h) * P(L > l + h | L > l, more than k turns)
    over the reference window of finished trajectories (final response length L, turns). Running trajectories
    advance one token per engine step together, so the sum of an engine's G is its expected KV h steps ahead with
    no new admission, and the peak of that sum is what kv_aware admits against: with heavy-tailed lengths most
    trajectories end before the long ones peak, so this admits far more than reserving final (or maximum) lengths,
    and it still sees the long ones coming. Sparse data: drop the turn condition, then fall back to a prior (a
    share of the budget). Vectors are on a grid of h (`grid(scale)`).

    `commit()` moves the trajectories finished in the batch just done into the reference window: estimates use
    whole batches only, because within a batch the first to finish are the short ones (a biased sample)."""

    POINTS = 49

    def __init__(self, window: int = 4096, prior_frac: float = 0.5, min_samples: int = 16):
        self.window, self.prior_frac, self.min_samples = window, prior_frac, min_samples
        self._ref: deque[tuple[int, int]] = deque(maxlen=window)
        self._batch: list[tuple[int, int]] = []
        self._tables: dict | None = None

    def observe(self, final_len: int, turns: int) -> None:
        self._batch.append((final_len, turns))

    def commit(self) -> None:
        if self._batch:
            self._ref.extend(self._batch)
            self._batch = []
            self._tables = None

    @property
    def samples(self) -> int:
        return len(self._ref)

    def grid(self, scale: float) -> np.ndarray:
        """The h grid (tokens ahead) for budgets up to `scale`."""
        return np.linspace(0.0, float(scale), self.POINTS)

    def footprint(self, length: int, turns: int, budget: int, h: np.ndarray, offset: int = 0,
                  block: int = 1) -> np.ndarray:
        """Response KV tokens held after h[j] more tokens, j over the grid: mean and variance, shape [2, POINTS]
        (held or not is a Bernoulli draw with the survival probability)."""
        tables = self._sorted()
        for k in (turns, None):
            lens = tables.get(k)  # sorted final lengths of the finished ones with more than k turns (or all)
            if lens is None:
                continue
            alive_now = len(lens) - np.searchsorted(lens, length, side="right")
            if alive_now >= self.min_samples:
                alive = (len(lens) - np.searchsorted(lens, length + h, side="right")) / alive_now  # [POINTS]
                break
        else:  # prior: ends after the expected remaining length
            rem = max(self.prior_frac * budget - length, 0.5 * (budget - length), 1.0)
            alive = (h < rem).astype(float)
        kv = offset + np.minimum(length + h, budget)
        if block > 1:  # KV is allocated in whole blocks
            kv = np.ceil(kv / block) * block
        return np.stack([kv * alive, kv ** 2 * alive * (1 - alive)])  # [2, POINTS]: mean, variance

    def _sorted(self) -> dict:
        """turns k (or None: any) -> sorted final lengths of the reference trajectories with more than k turns."""
        if self._tables is None:
            lens = np.array([x[0] for x in self._ref], dtype=float)
            turns = np.array([x[1] for x in self._ref], dtype=int)
            self._tables = {k: np.sort(lens if k is None else lens[turns > k])
                            for k in [None, *range(int(turns.max()) if len(turns) else 0)]}
        return self._tables

    @staticmethod
    def known(length: int, final: int, h: np.ndarray) -> np.ndarray:
        """The footprint of a trajectory whose final length is known (the clairvoyant oracle)."""
        fp = np.zeros((2, len(h)))
        fp[0] = (length + h) * (length + h < final)
        return fp


class TrajQueue:
    """The global queue of late-binding policies. Trajectories requeued after an engine failure come first.

    FIFO for least_requests. For kv_aware, an approximation of longest-first (what a clairvoyant scheduler does)
    from what is observable: rollouts of one prompt have correlated lengths (measured: `rollout_sim.icc`), so
    a queued rollout is ranked by how long its started siblings are so far (mean current length; finished ones at
    their final length). Each prompt first gets `probes` rollouts started, interleaved over prompts, so that
    every prompt has siblings to learn from."""

    def __init__(self, by_siblings: bool, probes: int = 2):
        self.by_siblings, self.probes = by_siblings, probes
        self._front: deque[int] = deque()
        self._fifo: deque[int] = deque()
        self._groups: dict[str, deque[int]] = {}
        self._started: dict[str, int] = {}
        self._len_sum: dict[str, float] = {}
        self._first: dict[str, int] = {}
        self._heap: list[tuple[tuple, int, str]] = []
        self._version: dict[str, int] = {}
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def push(self, tid: int, group: str) -> None:
        self._n += 1
        if not self.by_siblings:
            self._fifo.append(tid)
            return
        self._groups.setdefault(group, deque()).append(tid)
        self._first.setdefault(group, tid)
        self._touch(group)

    def push_front(self, tid: int) -> None:
        self._n += 1
        self._front.appendleft(tid)

    def peek(self) -> int | None:
        if self._front:
            return self._front[0]
        if not self.by_siblings:
            return self._fifo[0] if self._fifo else None
        while self._heap:
            _, ver, g = self._heap[0]
            if ver == self._version[g] and self._groups[g]:
                return self._groups[g][0]
            heapq.heappop(self._heap)
        return None

    def pop(self) -> int:
        tid = self.peek()
        if tid is None:
            raise IndexError("pop from an empty queue")
        self._n -= 1
        if self._front and self._front[0] == tid:
            return self._front.popleft()
        if not self.by_siblings:
            return self._fifo.popleft()
        g = self._heap[0][2]
        self._groups[g].popleft()
        self._touch(g)
        return tid

    def remove(self, tid: int, group: str) -> None:
        for q in (self._front, self._fifo, self._groups.get(group, ())):
            if tid in q:
                q.remove(tid)
                self._n -= 1
                if self.by_siblings and group in self._groups:
                    self._touch(group)
                return
        raise SchedulerError(f"trajectory {tid} is not queued")

    def started(self, group: str) -> None:
        if self.by_siblings:
            self._started[group] = self._started.get(group, 0) + 1
            self._touch(group)

    def grew(self, group: str, tokens: float) -> None:
        if self.by_siblings:
            self._len_sum[group] = self._len_sum.get(group, 0.0) + tokens
            self._touch(group)

    def _touch(self, g: str) -> None:
        """Re-rank group g (lazy heap: stale entries are skipped by version)."""
        self._version[g] = self._version.get(g, 0) + 1
        if self._groups.get(g):
            n = self._started.get(g, 0)
            mean = self._len_sum.get(g, 0.0) / n if n else 0.0
            key = (n >= self.probes, -mean, n, self._first[g])
            heapq.heappush(self._heap, (key, self._version[g], g))


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
    slack: float = 0.0  # admission may go this share over the budget (the queue's tail, see _set_margin)
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


def _most_roomy(rooms: np.ndarray, fits: np.ndarray) -> int:
    """The engine with the most room among those where the trajectory fits (at least one does)."""
    return int(np.argmax(np.where(fits, rooms, -np.inf)))


def _upper(load: np.ndarray, z: float) -> np.ndarray:
    """Mean + z standard deviations of summed footprints: load [..., 2, POINTS] (mean, variance) -> [..., POINTS]."""
    return load[..., 0, :] + z * np.sqrt(np.maximum(load[..., 1, :], 0))


class Scheduler:
    ORACLE_SCAN = 2  # oracle: how many of the next-longest to try when the longest fits nowhere

    def __init__(self, capacities: list[int], cfg: SchedulerCfg, policy: str | None = None,
                 estimator: LengthEstimator | None = None, block_size: int = 1):
        """capacities: KV tokens per engine; block_size: vLLM's KV block (tokens are allocated in whole blocks:
        16 on GPUs, 128 on CPU, where a tiny trajectory holds one block for ~120 tokens)."""
        self.policy = policy or cfg.policy
        self.block_size = max(1, int(block_size))
        if self.policy not in POLICIES:
            raise ValueError(f"unknown scheduling policy {self.policy!r}; choose from {', '.join(POLICIES)}")
        if not capacities or min(capacities) <= 0:
            raise ValueError(f"every engine needs a positive KV capacity in tokens, got {capacities}")
        self.cfg = cfg
        factor = 1.0 if self.policy.startswith("oracle") else cfg.oversubscribe
        self._loads = np.zeros((len(capacities), 2, LengthEstimator.POINTS))  # engine e's load is row e (a view)
        z = cfg.kv_z if self.policy == "kv_aware" else 0.0
        self.engines = [EngineView(int(c), factor, self._loads[e], z=z) for e, c in enumerate(capacities)]
        # per-engine mirrors of the views, so placement is a few vector operations (a paper-scale simulated step
        # places 16K trajectories on 64 engines): budget - prompts - lag, open for one more, idle
        n = len(capacities)
        self._base, self._can_take, self._idle = np.zeros(n), np.ones(n, bool), np.ones(n, bool)
        self._held, self._full = np.zeros(n), np.zeros(n)  # prompts + lag; factor x capacity
        self._siblings: dict[str, np.ndarray] = {}  # group -> its trajectories in flight per engine
        for e in range(n):
            self._sync(e)
        self.estimator = estimator or LengthEstimator(cfg.estimator_window, cfg.prior_frac)
        self.trajs: dict[int, TrajView] = {}
        self._queue = TrajQueue(self.policy == "kv_aware", cfg.probes_per_prompt)
        self._by_len: list[tuple[int, int]] = []  # oracle: (known footprint, tid), sorted
        self._started = False
        self._h: np.ndarray | None = None  # the footprint grid, fixed at the first dispatch
        self.factor_trace: list[tuple[float, int, float]] = []  # (time, engine, factor) after each change
        self._starts = 0

    @property
    def uses_priority(self) -> bool:
        """Whether engines should run vLLM's priority scheduling, with `priority(tid)` on every turn."""
        return self.policy == "kv_aware" and self.cfg.kv_priority

    def priority(self, tid: int) -> int:
        """vLLM priority of tid's turns (lower runs first and is preempted last): the trajectory's start order.
        vLLM's default (FCFS) orders by *turn* arrival, so a trajectory back from a tool call, holding the most KV,
        is the newest and the first preempted; by start order an overflow preempts the trajectory started last,
        whose context is the shortest (simulated, stage 1 tight KV: recompute 2.015 % -> 1.86 % of decoded tokens)."""
        tv = self.trajs[tid]
        return tv.rank if self.uses_priority and tv.rank is not None else 0

    # ---- trajectories in ------------------------------------------------------------------------------------
    def submit(self, tid: int, group: str, prompt_len: int, budget: int, now: float,
               known_len: int | None = None) -> None:
        if tid in self.trajs:
            raise SchedulerError(f"trajectory {tid} submitted twice")
        if budget <= 0:
            raise ValueError(f"trajectory {tid}: the response budget must be positive, got {budget}")
        if self.policy.startswith("oracle") and known_len is None:
            raise ValueError(f"policy {self.policy} needs every trajectory's final length (simulation only)")
        self.trajs[tid] = TrajView(tid, group, prompt_len, budget, now, known_len, queued_at=now)
        if self.policy == "oracle":
            bisect.insort(self._by_len, (prompt_len + known_len, tid))
        else:
            self._queue.push(tid, group)

    # ---- placement ------------------------------------------------------------------------------------------
    def dispatch(self, now: float) -> list[tuple[int, int]]:
        """(trajectory, engine) pairs to start now, in order. Early-binding policies hand everything out at once."""
        if not any(e.alive for e in self.engines):
            if self.queued:
                raise SchedulerError("no engine left alive, trajectories are still queued")
            return []
        if self._h is None:
            self._h = self.estimator.grid(max((t.budget for t in self.trajs.values()), default=1))
        if self.policy in LATE_BINDING:
            picks = {"least_requests": self._pick_least_requests, "kv_aware": self._pick_kv,
                     "oracle": self._pick_oracle}[self.policy]()
        else:
            picks = self._early_binding()
        for tid, _ in picks:
            tv = self.trajs[tid]
            tv.queue_wait_s += now - tv.queued_at
        return picks

    def _early_binding(self) -> list[tuple[int, int]]:
        """static / round_robin / oracle_static: assign the whole queue up front. Requeued trajectories (after an
        engine failure) go to the live engine with the fewest in flight."""
        alive = [i for i, e in enumerate(self.engines) if e.alive]
        picks: list[tuple[int, int]] = []
        if not self._started:
            self._started = True
            ids = [self._queue.pop() for _ in range(len(self._queue))]
            if self.policy == "static":  # contiguous blocks of whole prompts (groups in submission order)
                groups = list(dict.fromkeys(self.trajs[t].group for t in ids))
                block = {g: alive[i * len(alive) // len(groups)] for i, g in enumerate(groups)}
                picks = [(t, block[self.trajs[t].group]) for t in ids]
            elif self.policy == "round_robin":
                picks = [(t, alive[i % len(alive)]) for i, t in enumerate(ids)]
            else:  # oracle_static: LPT on the known work, longest first on each engine
                load = [(0, e) for e in alive]
                for t in sorted(ids, key=lambda t: -self.trajs[t].known_len):
                    w, e = heapq.heappop(load)
                    picks.append((t, e))
                    heapq.heappush(load, (w + self.trajs[t].known_len, e))
        for tid, e in picks:
            self._start(self.trajs[tid], e)
        while self._queue:
            e = min(alive, key=lambda i: len(self.engines[i].inflight))
            picks.append((self._queue.pop(), e))
            self._start(self.trajs[picks[-1][0]], e)
        return picks

    def _pick_least_requests(self) -> list[tuple[int, int]]:
        picks = []
        while self._queue and (e := self._open(key=lambda v: -len(v.inflight))) is not None:
            picks.append((self._queue.pop(), e))
            self._start(self.trajs[picks[-1][0]], e)
        return picks

    def _pick_kv(self) -> list[tuple[int, int]]:
        """Queue head to the engine with the most room left after it starts there, where its expected footprint
        fits the budget. An engine that already runs a sibling has the prompt's shared blocks already: the room
        counts that, so siblings go together where KV is otherwise even and spread where one engine fills up.
        (Spreading siblings first instead, against correlated lengths, was 1.10-1.11x the best schedule at stage 1
        and 1.25x at stage 2, against 1.06-1.07x and 1.19x now, at the measured within-prompt correlation: it paid
        a prompt's KV on every engine.) None fits: wait for a release, unless an engine is idle (a footprint larger
        than a whole budget must not deadlock)."""
        self._set_margin()
        picks = []
        while self._queue:
            tv = self.trajs[self._queue.peek()]
            fp = self._footprint(tv)
            rooms, fits = self._rooms(tv, fp)
            for i in np.flatnonzero(~fits & np.isfinite(rooms)):
                self.engines[i].blocked = True
            if not fits.any():
                break
            best = _most_roomy(rooms, fits)
            self._queue.pop()
            picks.append((tv.tid, best))
            self._start(tv, best, fp)
        return picks

    def _pick_oracle(self) -> list[tuple[int, int]]:
        """Longest known length first, to the engine with the most room where its true footprint fits (a few
        shorter ones are tried when the longest fits nowhere); nothing fits: wait for a release."""
        picks = []
        while self._by_len:
            placed = False
            for i in range(len(self._by_len) - 1, max(-1, len(self._by_len) - 1 - self.ORACLE_SCAN), -1):
                tv = self.trajs[self._by_len[i][1]]
                fp = self._footprint(tv)
                e = self._most_room(tv, fp)
                if e is not None:
                    self._by_len.pop(i)
                    picks.append((tv.tid, e))
                    self._start(tv, e, fp)
                    placed = True
                    break
            if not placed:
                break
        return picks

    def _set_margin(self) -> None:
        """kv_aware keeps kv_z standard deviations of room for the randomness of lengths, except when the rest of
        the queue, spread over the live engines, would fit their budgets within `kv_tail_slack` on the mean: then
        all of it is admitted now (margin 0, budget x (1 + slack)). Holding back the last few trajectories
        costs far more than a small overflow: one left waiting may be a long one that then sets the makespan,
        while an overflow of a few percent costs some recomputed prefill."""
        z, slack = self.cfg.kv_z, 0.0
        alive = [v for v in self.engines if v.alive]
        if self._queue and alive and self.cfg.kv_tail_slack > 0:
            share = -(-len(self._queue) // len(alive))  # queued trajectories per live engine, rounded up
            head = self.trajs[self._queue.peek()]
            fresh = self.estimator.footprint(0, 0, head.budget, self._h)[0] * share
            live = np.array([v.alive for v in self.engines])
            room = self._full[live] * (1 + self.cfg.kv_tail_slack) - self._held[live] - share * head.prompt_len
            if ((self._loads[live, 0] + fresh).max(axis=1) <= room).all():
                z, slack = 0.0, self.cfg.kv_tail_slack
        for e, v in enumerate(self.engines):
            if (v.z, v.slack) != (z, slack):
                v.z, v.slack = z, slack
                self._sync(e)

    def _most_room(self, tv: TrajView, fp: np.ndarray) -> int | None:
        """The engine with the most room where tv (footprint fp) fits."""
        rooms, fits = self._rooms(tv, fp)
        return _most_roomy(rooms, fits) if fits.any() else None

    def _rooms(self, tv: TrajView, fp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per engine: budget left over the coming tokens if tv (footprint fp) starts there (-inf where it cannot
        start: dead or at max_inflight), and whether it fits (an idle engine takes anything: a footprint larger
        than a whole budget must not deadlock)."""
        z = self.engines[0].z
        sib, shared = self._siblings.get(tv.group), self._shared_prompt(tv)
        charge = shared if sib is None else np.where(sib > 0, 0, shared)
        upper = _upper(self._loads + fp[None], z) if z else self._loads[:, 0] + fp[0]  # [E, POINTS]
        rooms = np.where(self._can_take, self._base - charge - upper.max(axis=1), -np.inf)  # [E]
        return rooms, self._can_take & ((rooms >= 0) | self._idle)

    def _sync(self, e: int) -> None:
        v = self.engines[e]
        self._held[e], self._full[e] = v.prompts + v.lag, v.factor * v.capacity
        self._base[e] = v.budget - v.prompts - v.lag
        self._can_take[e] = v.alive and len(v.inflight) < self.cfg.max_inflight
        self._idle[e] = not v.inflight

    def _open(self, key) -> int | None:
        """The live engine with room for one more trajectory that maximises key(engine view)."""
        best, best_key = None, None
        for i, v in enumerate(self.engines):
            if v.alive and len(v.inflight) < self.cfg.max_inflight:
                k = key(v)
                if best is None or k > best_key:
                    best, best_key = i, k
        return best

    def _footprint(self, tv: TrajView) -> np.ndarray | None:
        if self.policy == "oracle":
            return LengthEstimator.known(tv.response_len, tv.known_len, self._h)
        if self.policy != "kv_aware":
            return None
        own = tv.prompt_len - self._shared_prompt(tv)  # the prompt's partial last block, then the response
        return self.estimator.footprint(tv.response_len, tv.turns, tv.budget, self._h, own, self.block_size)

    def _shared_prompt(self, tv: TrajView) -> int:
        """The prompt KV all rollouts of a prompt on one engine share (vLLM's prefix cache shares whole blocks):
        charged once per engine; the partial last block is each trajectory's own, in its footprint."""
        return tv.prompt_len // self.block_size * self.block_size

    def _charge(self, v: EngineView, tv: TrajView) -> int:
        return 0 if v.groups.get(tv.group) else self._shared_prompt(tv)

    def _start(self, tv: TrajView, e: int, fp: np.ndarray | None = None) -> None:
        if tv.state != QUEUED:
            raise SchedulerError(f"trajectory {tv.tid} is {tv.state}, cannot start")
        v = self.engines[e]
        tv.state, tv.engine = RUNNING, e
        tv.footprint = fp if fp is not None else self._footprint(tv)
        if tv.footprint is not None:
            v.load += tv.footprint
        v.prompts += self._charge(v, tv)
        v.groups[tv.group] = v.groups.get(tv.group, 0) + 1
        self._prompt_away(v, tv)  # a new one is in a turn: its group's prompt is in vLLM's KV
        v.inflight.add(tv.tid)
        self._siblings.setdefault(tv.group, np.zeros(len(self.engines)))[e] += 1
        self._sync(e)
        v.dispatched += 1
        if tv.rank is None:  # kept when requeued after an engine failure
            tv.rank, self._starts = self._starts, self._starts + 1
        if not tv.requeues:
            self._queue.started(tv.group)

    # ---- progress and stats ---------------------------------------------------------------------------------
    def progress(self, tid: int, response_len: int, turns: int) -> None:
        """After a turn: the trajectory's response so far (tool tokens included) and its turns; re-estimates."""
        tv = self._running(tid)
        self._queue.grew(tv.group, response_len - tv.response_len)
        tv.response_len, tv.turns = response_len, turns
        if tv.footprint is not None:
            v = self.engines[tv.engine]
            new = self._footprint(tv)
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
            v.away += self._shared_prompt(tv) if all_away else -self._shared_prompt(tv)

    def observe_engine(self, e: int, now: float, usage: float, preemptions_total: int) -> None:
        """vLLM's own stats for engine e: KV usage (fraction of blocks in use) and cumulative preemptions.

        kv_aware adapts the engine's factor (multiplicatively, at most once per `adapt_interval_s`): it shrinks
        after a preemption or above `usage_high`; it grows while usage stays below `usage_low`, admission is
        blocked, and what runs already holds at least `grow_when_realized` of its expected peak. That last guard
        matters: right after admission every trajectory is short, so low usage says nothing yet."""
        v = self.engines[e]
        v.usage = usage
        v.lag = max(0.0, usage * v.capacity - (float(v.load[0, 0]) - v.away) - v.prompts)
        self._sync(e)
        # vLLM counts preemptions over the engine's life (engines outlive RL steps): the first report is a baseline
        preempted = v.preemptions_seen is not None and preemptions_total > v.preemptions_seen
        v.preemptions_seen = max(v.preemptions_seen or 0, preemptions_total)
        if self.policy != "kv_aware" or now - v.last_adapt < self.cfg.adapt_interval_s:
            return
        c = self.cfg
        if preempted or usage > c.usage_high:
            v.factor = max(c.oversubscribe_min, v.factor * 0.85)
        elif usage < c.usage_low and v.blocked and usage * v.capacity >= c.grow_when_realized * v.peak:
            v.factor = min(c.oversubscribe_max, v.factor * 1.1)
        else:
            return
        v.blocked, v.last_adapt = False, now
        self._sync(e)
        self.factor_trace.append((now, e, v.factor))

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
        elif self.policy == "oracle":
            self._by_len.remove((tv.prompt_len + tv.known_len, tid))
        else:
            self._queue.remove(tid, tv.group)
        tv.state, tv.outcome = DONE, outcome
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
            if self.policy == "oracle":
                bisect.insort(self._by_len, (tv.prompt_len + tv.known_len, tid))
            else:
                self._queue.push_front(tid)
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
            v.prompts -= self._shared_prompt(tv)
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
        return len(self._queue) + len(self._by_len)

    @property
    def done(self) -> bool:
        return all(t.state == DONE for t in self.trajs.values())

    def summary(self) -> dict:
        waits = np.array([t.queue_wait_s for t in self.trajs.values()]) if self.trajs else np.zeros(1)
        return {"policy": self.policy, "queue_wait_mean_s": float(waits.mean()),
                "queue_wait_p95_s": float(np.quantile(waits, 0.95)),
                "requeued": int(sum(t.requeues for t in self.trajs.values())),
                "dispatched_per_engine": [v.dispatched for v in self.engines],
                "factor_final": [round(v.factor, 3) for v in self.engines],
                "estimator_samples": self.estimator.samples}
