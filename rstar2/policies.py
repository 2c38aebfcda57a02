"""Rollout scheduling policies (paper §3.2 "load-balanced rollout scheduler"): each one a
small class that owns the queue of trajectories not running and decides which starts on which engine. The books they
read and write (engines' KV load and room, trajectories' state) are rstar2.scheduler.Scheduler's.

  static          the common default (verl): a prompt's rollouts together, prompts split into contiguous blocks of
                  engines, everything sent at t=0 (the engine queues and preempts on its own)
  round_robin     trajectory i -> engine i mod E at t=0 (a prompt's rollouts spread over engines)
  least_requests  late binding from a global queue to the engine with the fewest in flight, up to max_inflight
  kv_aware        late binding by KV tokens: each trajectory reserves its *expected* footprint (context so far +
                  expected remaining response, learned from finished trajectories given its length and turn count),
                  an engine admits while its reservations fit factor x its KV capacity, the factor adapts to the
                  engine's measured KV usage and preemptions, and the queue head goes to the most headroom

The clairvoyant oracles (every final length known) are policies of the simulator (bench.rollout_sim). A policy
gets the scheduler as `s` and uses its public placement API: `place`, `rooms`, `shared_prompt`, `sync`, `grid`,
`engines`, `trajs`, `cfg`, `estimator`, `block_size`, `loads`, `held`, `full`.
"""

from __future__ import annotations

import heapq
from collections import deque

import numpy as np


class TrajQueue:
    """The global queue of late-binding policies. Trajectories requeued after an engine failure come first.

    FIFO for least_requests. For kv_aware, an approximation of longest-first (what a clairvoyant scheduler does)
    from what is observable: rollouts of one prompt have correlated lengths (measured: `bench.rollout_sim.icc`), so
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
        raise LookupError(f"trajectory {tid} is not queued")

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


def most_roomy(rooms: np.ndarray, fits: np.ndarray) -> int:
    """The engine with the most room among those where the trajectory fits (at least one does)."""
    return int(np.argmax(np.where(fits, rooms, -np.inf)))


def most_room(s, tv, fp: np.ndarray | None) -> int | None:
    """The engine with the most room where tv (footprint fp) fits, None if none."""
    rooms, fits = s.rooms(tv, fp)
    return most_roomy(rooms, fits) if fits.any() else None


class Policy:
    """A placement rule. It owns the queue of trajectories not running (`push`, `requeue` to its front after an
    engine failure, `remove`), places them (`pick`: the (trajectory, engine) pairs started now, each through
    `s.place`), says what a trajectory is expected to hold in KV (`footprint`, None: not counted) and how an engine's
    budget reacts to vLLM's stats (`adapt`)."""

    name = ""
    oversubscribes = True  # an engine's KV budget starts at cfg.oversubscribe x its capacity (else 1 x)
    needs_lengths = False  # every trajectory's final length is known at submit (the simulator's oracles)

    def __init__(self, s):
        self.s = s
        self.queue = TrajQueue(by_siblings=False)

    @property
    def z(self) -> float:
        """Standard deviations of room kept for the randomness of lengths."""
        return 0.0

    @property
    def uses_priority(self) -> bool:
        """Whether engines run vLLM's priority scheduling with the trajectory's start order on every turn."""
        return False

    def __len__(self) -> int:
        return len(self.queue)

    def push(self, tv) -> None:
        self.queue.push(tv.tid, tv.group)

    def requeue(self, tv) -> None:
        self.queue.push_front(tv.tid)

    def remove(self, tv) -> None:
        self.queue.remove(tv.tid, tv.group)

    def started(self, tv) -> None:
        self.queue.started(tv.group)

    def grew(self, tv, tokens: float) -> None:
        self.queue.grew(tv.group, tokens)

    def pick(self) -> list[tuple[int, int]]:
        raise NotImplementedError

    def fill_least_loaded(self, open_engines) -> list[tuple[int, int]]:
        """Queue head to the engine of `open_engines()` with the fewest turns in flight, until the queue or the open
        engines run out; returns (tid, engine) in placement order."""
        s, picks = self.s, []
        while self.queue and (open_ := open_engines()):
            e = min(open_, key=lambda i: len(s.engines[i].inflight))
            picks.append((self.queue.pop(), e))
            s.place(s.trajs[picks[-1][0]], e)
        return picks

    def footprint(self, tv) -> np.ndarray | None:
        return None

    def adapt(self, e: int, now: float, usage: float, preempted: bool) -> None:
        """vLLM's stats for engine e just came in (the books are updated)."""


class EarlyBinding(Policy):
    """Everything is placed at the first dispatch (`assign`); a trajectory requeued after an engine failure goes to
    the live engine with the fewest in flight."""

    def __init__(self, s):
        super().__init__(s)
        self._assigned = False

    def assign(self, ids: list[int], alive: list[int]) -> list[tuple[int, int]]:
        raise NotImplementedError

    def pick(self) -> list[tuple[int, int]]:
        s = self.s
        alive = [i for i, e in enumerate(s.engines) if e.alive]
        picks: list[tuple[int, int]] = []
        if not self._assigned:
            self._assigned = True
            picks = self.assign([self.queue.pop() for _ in range(len(self.queue))], alive)
            for tid, e in picks:
                s.place(s.trajs[tid], e)
        return picks + self.fill_least_loaded(lambda: alive)


class Static(EarlyBinding):
    """Contiguous blocks of whole prompts (groups in submission order) per engine."""

    name = "static"

    def assign(self, ids, alive):
        groups = list(dict.fromkeys(self.s.trajs[t].group for t in ids))
        block = {g: alive[i * len(alive) // len(groups)] for i, g in enumerate(groups)}
        return [(t, block[self.s.trajs[t].group]) for t in ids]


class RoundRobin(EarlyBinding):
    """Trajectory i to engine i mod E."""

    name = "round_robin"

    def assign(self, ids, alive):
        return [(t, alive[i % len(alive)]) for i, t in enumerate(ids)]


class LeastRequests(Policy):
    """FIFO to the live engine with the fewest in flight, up to cfg.max_inflight each."""

    name = "least_requests"

    def pick(self) -> list[tuple[int, int]]:
        s = self.s
        return self.fill_least_loaded(
            lambda: [i for i, v in enumerate(s.engines) if v.alive and len(v.inflight) < s.cfg.max_inflight])


class KvAware(Policy):
    """Late binding by expected KV (module docstring); the queue ranks prompts by their started siblings' lengths."""

    name = "kv_aware"

    def __init__(self, s):
        super().__init__(s)
        self.queue = TrajQueue(by_siblings=True, probes=s.cfg.probes_per_prompt)

    @property
    def z(self) -> float:
        return self.s.cfg.kv_z

    @property
    def uses_priority(self) -> bool:
        return self.s.cfg.kv_priority

    def footprint(self, tv) -> np.ndarray:
        s = self.s
        own = tv.prompt_len - s.shared_prompt(tv)  # the prompt's partial last block, then the response
        return s.estimator.footprint(tv.response_len, tv.turns, tv.budget, s.grid, own, s.block_size)

    def pick(self) -> list[tuple[int, int]]:
        """Queue head to the engine with the most room left after it starts there, where its expected footprint
        fits the budget. An engine that already runs a sibling has the prompt's shared blocks already: the room
        counts that, so siblings go together where KV is otherwise even and spread where one engine fills up
        (spreading siblings first paid a prompt's KV on every engine: slower in simulation at the measured
        within-prompt correlation). None fits: wait for a release, unless an engine is idle (a footprint larger
        than a whole budget must not deadlock)."""
        s = self.s
        self._set_margin()
        picks = []
        while self.queue:
            tv = s.trajs[self.queue.peek()]
            fp = self.footprint(tv)
            rooms, fits = s.rooms(tv, fp)
            for i in np.flatnonzero(~fits & np.isfinite(rooms)):
                s.engines[i].blocked = True
            if not fits.any():
                break
            best = most_roomy(rooms, fits)
            self.queue.pop()
            picks.append((tv.tid, best))
            s.place(tv, best, fp)
        return picks

    def _set_margin(self) -> None:
        """kv_z standard deviations of room for the randomness of lengths, except when the rest of the queue, spread
        over the live engines, would fit their budgets within `kv_tail_slack` on the mean: then all of it is admitted
        now (margin 0, budget x (1 + slack)). Holding back the last few trajectories costs far more than a small
        overflow: one left waiting may be a long one that then sets the makespan, while an overflow of a few
        percent costs some recomputed prefill."""
        s, cfg = self.s, self.s.cfg
        z, slack = cfg.kv_z, 0.0
        alive = [v for v in s.engines if v.alive]
        if self.queue and alive and cfg.kv_tail_slack > 0:
            share = -(-len(self.queue) // len(alive))  # queued trajectories per live engine, rounded up
            head = s.trajs[self.queue.peek()]
            fresh = s.estimator.footprint(0, 0, head.budget, s.grid)[0] * share
            live = np.array([v.alive for v in s.engines])
            room = s.full[live] * (1 + cfg.kv_tail_slack) - s.held[live] - share * head.prompt_len
            if ((s.loads[live, 0] + fresh).max(axis=1) <= room).all():
                z, slack = 0.0, cfg.kv_tail_slack
        for e, v in enumerate(s.engines):
            if (v.z, v.slack) != (z, slack):
                v.z, v.slack = z, slack
                s.sync(e)

    def adapt(self, e: int, now: float, usage: float, preempted: bool) -> None:
        """The engine's factor adapts multiplicatively, at most once per `adapt_interval_s`: it shrinks after a
        preemption or above `usage_high`; it grows while usage stays below `usage_low`, admission is blocked, and
        what runs already holds at least `grow_when_realized` of its expected peak. That last guard matters: right
        after admission every trajectory is short, so low usage says nothing yet."""
        s, c = self.s, self.s.cfg
        v = s.engines[e]
        if now - v.last_adapt < c.adapt_interval_s:
            return
        if preempted or usage > c.usage_high:
            v.factor = max(c.oversubscribe_min, v.factor * 0.85)
        elif usage < c.usage_low and v.blocked and usage * v.capacity >= c.grow_when_realized * v.peak:
            v.factor = min(c.oversubscribe_max, v.factor * 1.1)
        else:
            return
        v.blocked, v.last_adapt = False, now
        s.sync(e)


# SchedulerCfg.policy names -> policies (the simulator adds its oracles: bench.rollout_sim.ORACLES)
POLICIES: dict[str, type[Policy]] = {p.name: p for p in (Static, RoundRobin, LeastRequests, KvAware)}
