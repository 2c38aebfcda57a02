"""Rollout scheduling policies (paper §3.2 "load-balanced rollout scheduler"): each one a
small class that owns the queue of trajectories not running and decides which starts on which engine. The books they
read (engines' KV load and room, trajectories' state) are rstar2.rollout.scheduler.Scheduler's, which alone writes them.

  static          the common default (verl): a prompt's rollouts together, prompts split into contiguous blocks of
                  engines, everything sent at t=0 (the engine queues and preempts on its own)
  round_robin     trajectory i -> engine i mod E at t=0 (a prompt's rollouts spread over engines)
  least_requests  late binding from a global queue to the engine with the fewest in flight, up to max_inflight
  kv_aware        late binding by KV tokens: each trajectory reserves its *expected* footprint (context so far +
                  expected remaining response, learned from finished trajectories given its length and turn count),
                  an engine admits while its reservations fit factor x its KV capacity, the factor adapts to the
                  engine's measured KV usage and preemptions, and the queue head goes to the most headroom

The clairvoyant oracles (every final length known) are policies of the simulator (rstar2.bench.rollout_sim). A policy
gets a read-only view of the books as `s` (rstar2.rollout.scheduler.PolicyView) and changes nothing itself: it returns
its decisions (`Placement`, `Refused`, `Margin`, a new factor), which the scheduler applies to its books.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Placement:
    """Start queued trajectory `tid` on `engine`; `footprint`: its expected KV if the policy computed it already
    (None: the scheduler asks the policy's `footprint`)."""
    tid: int
    engine: int
    footprint: np.ndarray | None = None


@dataclass(frozen=True)
class Refused:
    """Admission was refused on these engines for lack of room (kv_aware grows a factor only after that)."""
    engines: np.ndarray  # engine indices, [k]


@dataclass(frozen=True)
class Margin:
    """Every engine's admission margin for this dispatch: z standard deviations of room, and the share it may go
    over its budget."""
    z: float
    slack: float


class TrajQueue:
    """The global queue of late-binding policies. Trajectories requeued after an engine failure come first.

    FIFO for least_requests. For kv_aware, an approximation of longest-first (what a clairvoyant scheduler does) from
    what is observable: rollouts of one prompt have correlated lengths (measured: `rstar2.bench.rollout_sim.icc`), so a
    queued rollout is ranked by how long its started siblings are so far (mean current length; finished ones at their
    final length). Each prompt first gets `probes` rollouts started, interleaved over prompts, so that every prompt has
    siblings to learn from."""

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
    engine failure, `remove`), places them (`pick`: one `Placement` at a time, which the scheduler applies before
    asking for the next, so each decision sees the ones before), says what a trajectory is expected to hold in KV
    (`footprint`, None: not counted), the admission margin of a dispatch (`margin`) and how an engine's budget reacts
    to vLLM's stats (`adapt`). `s` is a read-only view of the scheduler's books."""

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

    def pick(self) -> Iterator[Placement | Refused]:
        """The queued trajectories to start now, in order; the books include each placement when the next is asked."""
        raise NotImplementedError

    def fill_least_loaded(self, open_engines: Callable[[], list[int]]) -> Iterator[Placement]:
        """Queue head to the engine of `open_engines()` with the fewest trajectories in flight (the first such),
        until the queue or the open engines run out."""
        inflight = self.s.inflight
        while self.queue and (open_ := open_engines()):
            e = min(open_, key=lambda i: inflight[i])
            yield Placement(self.queue.pop(), e)

    def footprint(self, tv) -> np.ndarray | None:
        return None

    def margin(self) -> Margin | None:
        """Every engine's admission margin for the coming picks (None: unchanged)."""
        return None

    def adapt(self, e: int, now: float, usage: float, preempted: bool) -> float | None:
        """vLLM's stats for engine e just came in (the books are updated): its new factor, None: unchanged."""
        return None


class EarlyBinding(Policy):
    """Everything is placed at the first dispatch (`assign`); a trajectory requeued after an engine failure goes to
    the live engine with the fewest in flight."""

    def __init__(self, s):
        super().__init__(s)
        self._assigned = False

    def assign(self, ids: list[int], alive: list[int]) -> list[tuple[int, int]]:
        raise NotImplementedError

    def pick(self) -> Iterator[Placement]:
        alive = np.flatnonzero(self.s.alive).tolist()
        if not self._assigned:
            self._assigned = True
            for tid, e in self.assign([self.queue.pop() for _ in range(len(self.queue))], alive):
                yield Placement(tid, e)
        yield from self.fill_least_loaded(lambda: alive)


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

    def pick(self) -> Iterator[Placement]:
        s = self.s
        return self.fill_least_loaded(lambda: np.flatnonzero(s.alive & (s.inflight < s.cfg.max_inflight)).tolist())


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

    def pick(self) -> Iterator[Placement | Refused]:
        """Queue head to the engine with the most room left after it starts there, where its expected footprint
        fits the budget. An engine that already runs a sibling has the prompt's shared blocks already: the room
        counts that, so siblings go together where KV is otherwise even and spread where one engine fills up
        (spreading siblings first paid a prompt's KV on every engine: slower in simulation at the measured
        within-prompt correlation). None fits: wait for a release, unless an engine is idle (a footprint larger
        than a whole budget must not deadlock). Engines where the head did not fit are reported (`Refused`)."""
        s = self.s
        while self.queue:
            tv = s.trajs[self.queue.peek()]
            fp = self.footprint(tv)
            rooms, fits = s.rooms(tv, fp)
            refused = np.flatnonzero(~fits & np.isfinite(rooms))
            if refused.size:
                yield Refused(refused)
            if not fits.any():
                return
            best = most_roomy(rooms, fits)
            self.queue.pop()
            yield Placement(tv.tid, best, fp)

    def margin(self) -> Margin:
        """kv_z standard deviations of room for the randomness of lengths, except when the rest of the queue, spread
        over the live engines, would fit their budgets within `kv_tail_slack` on the mean: then all of it is admitted
        now (margin 0, budget x (1 + slack)). Holding back the last few trajectories costs far more than a small
        overflow: one left waiting may be a long one that then sets the makespan, while an overflow of a few
        percent costs some recomputed prefill."""
        s, cfg = self.s, self.s.cfg
        live = s.alive
        n_alive = int(np.count_nonzero(live))
        if self.queue and n_alive and cfg.kv_tail_slack > 0:
            share = -(-len(self.queue) // n_alive)  # queued trajectories per live engine, rounded up
            head = s.trajs[self.queue.peek()]
            fresh = s.estimator.footprint(0, 0, head.budget, s.grid)[0] * share  # [POINTS]
            room = s.admit_kv[live] * (1 + cfg.kv_tail_slack) - s.outside_kv[live] - share * head.prompt_len
            if ((s.load_mean[live] + fresh).max(axis=1) <= room).all():
                return Margin(0.0, cfg.kv_tail_slack)
        return Margin(cfg.kv_z, 0.0)

    def adapt(self, e: int, now: float, usage: float, preempted: bool) -> float | None:
        """The engine's factor adapts multiplicatively, at most once per `adapt_interval_s`: it shrinks after a
        preemption or above `usage_high`; it grows while usage stays below `usage_low`, admission is blocked, and
        what runs already holds at least `grow_when_realized` of its expected peak. That last guard matters: right
        after admission every trajectory is short, so low usage says nothing yet."""
        s, c = self.s, self.s.cfg
        v = s.engine(e)
        if now - v.last_adapt < c.adapt_interval_s:
            return None
        if preempted or usage > c.usage_high:
            return max(c.oversubscribe_min, v.factor * 0.85)
        if usage < c.usage_low and v.blocked and usage * v.capacity >= c.grow_when_realized * v.peak:
            return min(c.oversubscribe_max, v.factor * 1.1)
        return None


# SchedulerCfg.policy names -> policies (the simulator adds its oracles: rstar2.bench.rollout_sim.ORACLES)
POLICIES: dict[str, type[Policy]] = {p.name: p for p in (Static, RoundRobin, LeastRequests, KvAware)}
