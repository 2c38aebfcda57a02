"""A discrete-event simulator of one rollout step on many vLLM engines, driven through the *same*
`rstar2.rollout.scheduler.SchedulerSession` as the real agent loop: it answers how the policies compare at the paper's
scale (64 engines, 512 x 32 trajectories), which this machine cannot run. It adds two clairvoyant policies that know
every trajectory's final length, as references: `oracle` (late binding, longest first, admitted while the engine's true
future KV fits) and `oracle_static` (longest-processing-time-first balance at t=0).

Engine model (one engine = one vLLM instance), with vLLM's semantics:
  * continuous batching: every running sequence decodes one token per step; a step costs
        t0 + max(weights_s + kv_s * K,  dec_s * n + prefill_s * P)
    (memory-bound weight + KV read vs compute), K = KV tokens of the running sequences, n = running sequences,
    P = tokens prefilled in that step (new prompts, tool outputs, recomputation);
  * FCFS admission with head-of-line blocking, at most `max_num_seqs` running, while KV has room;
  * a sequence waiting on a tool keeps its KV only as evictable prefix cache (LRU): admissions and decode growth
    evict it, and its next turn then re-prefills the whole context;
  * decode growth that does not fit preempts the newest running sequence (vLLM V1: recompute); with priority
    scheduling (kv_aware's start order), the largest (priority, arrival) instead, and the waiting queue is
    ordered by (priority, arrival);
  * rollouts of one prompt on one engine share the prompt's KV (prefix caching);
  * the scheduler is told what vLLM reports: KV usage of the running batch (cached prefixes count as free) and
    preemptions (prefix-cache evictions are not counted).
Between events (a turn ends, KV runs out, a request arrives) the batch is constant and its context grows by n
per step, so k steps take a closed-form time: the simulator jumps event to event (a paper-scale step in seconds).

Workload (per trajectory): response length R ~ lognormal, log R = mu + sigma (sqrt(rho) z_prompt +
sqrt(1 - rho) z_rollout), capped at the budget (rho: within-prompt correlation of lengths, measured from real
rollouts by `icc()`); 1 + Poisson(tool_calls * R / mean R) turns; tool outputs lognormal (median 40 tokens) counted
in R; decode tokens split over the turns (Dirichlet); tool latencies from a model or recorded real calls.
"""

from __future__ import annotations

import bisect
import glob
import heapq
import json
import math
from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from rstar2.core.config import SchedulerCfg
from rstar2.rollout.estimator import LengthEstimator
from rstar2.rollout.policies import POLICIES, EarlyBinding, Placement, Policy, most_room
from rstar2.rollout.scheduler import END, TOOL, Scheduler, SchedulerSession


# ---- the clairvoyant policies ---------------------------------------------------------------------------------
def known_footprint(length: int, final: int, h: np.ndarray) -> np.ndarray:
    """The footprint of a trajectory whose final length is known: length + h tokens while it runs, then none."""
    fp = np.zeros((2, len(h)))
    fp[0] = (length + h) * (length + h < final)
    return fp


class Oracle(Policy):
    """Longest known length first, to the engine with the most room where its true footprint fits its KV capacity
    (a few shorter ones are tried when the longest fits nowhere); nothing fits: wait for a release."""

    name = "oracle"
    oversubscribes = False
    needs_lengths = True
    SCAN = 2

    def __init__(self, s):
        super().__init__(s)
        self._by_len: list[tuple[int, int]] = []  # (prompt + final length, tid), sorted

    def __len__(self) -> int:
        return len(self._by_len)

    def push(self, tv) -> None:
        bisect.insort(self._by_len, (tv.prompt_len + tv.known_len, tv.tid))

    requeue = push

    def remove(self, tv) -> None:
        self._by_len.remove((tv.prompt_len + tv.known_len, tv.tid))

    def footprint(self, tv) -> np.ndarray:
        return known_footprint(tv.response_len, tv.known_len, self.s.grid)

    def pick(self) -> Iterator[Placement]:
        s = self.s
        while self._by_len:
            for i in range(len(self._by_len) - 1, max(-1, len(self._by_len) - 1 - self.SCAN), -1):
                tv = s.trajs[self._by_len[i][1]]
                fp = self.footprint(tv)
                e = most_room(s, tv, fp)
                if e is not None:
                    self._by_len.pop(i)
                    yield Placement(tv.tid, e, fp)
                    break
            else:
                return


class OracleStatic(EarlyBinding):
    """Longest-processing-time-first balance of the known lengths at t=0, longest first on each engine."""

    name = "oracle_static"
    oversubscribes = False
    needs_lengths = True

    def assign(self, ids, alive):
        load, picks = [(0, e) for e in alive], []
        for t in sorted(ids, key=lambda t: -self.s.trajs[t].known_len):
            w, e = heapq.heappop(load)
            picks.append((t, e))
            heapq.heappush(load, (w + self.s.trajs[t].known_len, e))
        return picks


ORACLES: dict[str, type[Policy]] = {p.name: p for p in (Oracle, OracleStatic)}
SIM_POLICIES: dict[str, type[Policy]] = {**POLICIES, **ORACLES}


# ---- hardware and workload models ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Hardware:
    """Step-time coefficients (seconds) and KV capacity (tokens) of one engine. Defaults: Qwen3-14B bf16 on one
    MI300X: solo 8K context 12.4 ms/step, batch 256 at 3K 46 ms."""
    capacity: int = 750_000
    t0: float = 4e-3
    weights_s: float = 8.0e-3
    kv_s: float = 4.4e-8  # per KV token read per step
    dec_s: float = 5.7e-5  # per decoded token (compute)
    prefill_s: float = 4.5e-5  # per prefilled token
    max_num_seqs: int = 1024

    def step_time(self, n: int, kv: float, prefill: float = 0.0) -> float:
        return self.t0 + max(self.weights_s + self.kv_s * kv, self.dec_s * n + self.prefill_s * prefill)


@dataclass(frozen=True)
class ToolLatency:
    """Seconds per tool call: lognormal with the given mean, plus a share of calls that hit the timeout; or, with
    `samples`, resampled from recorded real calls."""
    mean_s: float = 0.22
    sigma: float = 0.8
    timeout_frac: float = 0.02
    timeout_s: float = 4.0
    samples: tuple[float, ...] = ()

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.samples:
            return rng.choice(np.asarray(self.samples), size=n)
        mu = math.log(self.mean_s) - self.sigma ** 2 / 2
        lat = rng.lognormal(mu, self.sigma, size=n)
        return np.where(rng.random(n) < self.timeout_frac, self.timeout_s, np.minimum(lat, self.timeout_s))


TOOLS = {"base": ToolLatency(), "fast": ToolLatency(0.1, 0.8, 0.005), "slow": ToolLatency(1.0, 1.0, 0.05)}


@dataclass(frozen=True)
class Stage:
    """Response-length model of an RL stage (from the paper's length curves)."""
    cap: int
    median: float
    sigma: float
    max_turns: int


STAGES = {"s1": Stage(8192, 3430, 0.74, 10), "s2": Stage(12288, 5230, 0.67, 15), "s3": Stage(12288, 7780, 0.60, 15)}


@dataclass(frozen=True)
class WorkloadSpec:
    prompts: int
    samples: int
    stage: Stage
    icc: float
    tools: ToolLatency = TOOLS["base"]
    tool_calls: float = 3.0  # mean tool calls of a mean-length trajectory
    prompt_median: float = 380
    prompt_sigma: float = 0.5
    prompt_range: tuple[int, int] = (150, 2048)
    tool_out_median: float = 40
    tool_out_range: tuple[int, int] = (5, 1024)


@dataclass
class Workload:
    """Per trajectory (index = trajectory id; group = prompt index): prompt length, decode tokens per turn, tool
    output tokens and tool latency after each non-final turn."""
    group: np.ndarray
    prompt_len: np.ndarray
    decode: list[list[int]]
    tool_out: list[list[int]]
    tool_s: list[list[float]]
    cap: int

    @property
    def response_len(self) -> np.ndarray:
        return np.array([sum(d) + sum(o) for d, o in zip(self.decode, self.tool_out)])

    @property
    def turns(self) -> np.ndarray:
        return np.array([len(d) for d in self.decode])


def make_workload(spec: WorkloadSpec, rng: np.random.Generator) -> Workload:
    st, n = spec.stage, spec.prompts * spec.samples
    group = np.repeat(np.arange(spec.prompts), spec.samples)
    lo, hi = spec.prompt_range
    prompt = np.clip(rng.lognormal(math.log(spec.prompt_median), spec.prompt_sigma, spec.prompts), lo, hi)
    z = math.sqrt(spec.icc) * rng.standard_normal(spec.prompts)[group] + \
        math.sqrt(1 - spec.icc) * rng.standard_normal(n)
    resp = np.minimum(np.exp(math.log(st.median) + st.sigma * z), st.cap).astype(int)
    turns = np.minimum(1 + rng.poisson(spec.tool_calls * resp / resp.mean()), st.max_turns)
    decode, tool_out, tool_s = [], [], []
    for r, t in zip(resp, turns):
        lo_o, hi_o = spec.tool_out_range
        outs = np.clip(rng.lognormal(math.log(spec.tool_out_median), 1.0, t - 1), lo_o, hi_o).astype(int)
        if outs.sum() > r // 2:  # tool outputs never take more than half of a response
            outs = np.maximum(1, (outs * (r // 2) / max(1, outs.sum())).astype(int))
        dec = max(int(t), int(r - outs.sum()))
        split = np.maximum(1, np.floor(rng.dirichlet(np.ones(t)) * dec).astype(int))
        split[-1] += dec - split.sum()
        if split[-1] < 1:  # rounding pushed the last turn below one token: take from the longest
            k = int(np.argmax(split[:-1]))
            split[k] += split[-1] - 1
            split[-1] = 1
        decode.append(split.tolist())
        tool_out.append(outs.tolist())
        tool_s.append(spec.tools.draw(rng, t - 1).tolist())
    return Workload(group, prompt.astype(int)[group], decode, tool_out, tool_s, st.cap)


def icc(groups, lengths) -> float:
    """Within-prompt correlation of log response lengths: one-way random-effects ICC(1) over prompt groups
    (ANOVA estimator, unequal group sizes allowed, clipped to [0, 1])."""
    g = np.asarray(groups)
    y = np.log(np.maximum(1.0, np.asarray(lengths, dtype=float)))
    keys, inv, counts = np.unique(g, return_inverse=True, return_counts=True)
    if len(keys) < 2 or len(y) <= len(keys):
        raise ValueError("icc needs at least two prompt groups and more rollouts than groups")
    means = np.bincount(inv, weights=y) / counts
    msb = np.sum(counts * (means - y.mean()) ** 2) / (len(keys) - 1)
    msw = np.sum((y - means[inv]) ** 2) / (len(y) - len(keys))
    k0 = (len(y) - np.sum(counts ** 2) / len(y)) / (len(keys) - 1)
    return float(np.clip((msb - msw) / (msb + (k0 - 1) * msw), 0.0, 1.0))


# ---- one engine -------------------------------------------------------------------------------------------
@dataclass
class _Seq:
    tid: int
    group: int
    prompt: int
    ctx: int  # context when it joined the batch (prompt included)
    joined: int  # engine step when it joined
    end: int  # engine step at which its turn's last token is out
    order: int  # admission order (vLLM preempts the newest)
    priority: int = 0


@dataclass
class _Req:
    tid: int
    group: int
    prompt: int
    total: int  # context once this request's new tokens are prefilled (prompt included)
    computed: int  # tokens of it computed before (0 for a new trajectory): a prefix-cache hit if still cached
    decode: int
    priority: int = 0  # vLLM's priority scheduling: lower runs first and is preempted last
    arrival: int = 0


class SimEngine:
    """vLLM-like continuous batching on one engine, advanced in closed-form jumps (see module docstring)."""

    def __init__(self, hw: Hardware, by_priority: bool = False):
        self.hw, self.by_priority = hw, by_priority
        self._arrivals = 0
        self.clock = 0.0  # time of the last step boundary
        self.step = 0
        self.running: dict[int, _Seq] = {}
        self.ends: list[tuple[int, int, int]] = []  # heap of (end step, admission order, tid); stale ones skipped
        self.sum_a = 0  # sum over running of (ctx - prompt - joined)
        self.group_refs: dict[int, int] = {}  # group -> running sequences of it
        self.group_kv = 0  # the running groups' prompts, once each (shared prefix)
        self.waiting: deque[_Req] = deque()
        self.cached: OrderedDict[int, int] = OrderedDict()  # tid -> response KV kept as prefix cache (LRU)
        self.cached_kv = 0
        self.prefill_next = 0  # tokens to prefill in the next step
        self._order = 0
        self.busy_s = self.batch_s = 0.0
        self.decoded = self.prefilled = self.recomputed = 0
        self.preemptions = self.evictions = 0

    @property
    def kv(self) -> int:
        """KV tokens of the running batch: responses so far plus each running group's prompt once."""
        return self.sum_a + len(self.running) * self.step + self.group_kv

    @property
    def usage(self) -> float:
        """KV in use as vLLM reports it (`kv_cache_usage`): the running batch's blocks. A tool-waiting sequence's
        cached prefix has no owner and counts as free (evictable), as in vLLM's block pool."""
        return self.kv / self.hw.capacity

    def _join(self, r: _Req) -> None:
        if not self.group_refs.get(r.group):
            self.group_kv += r.prompt
        self.group_refs[r.group] = self.group_refs.get(r.group, 0) + 1
        self._order += 1
        self.running[r.tid] = _Seq(r.tid, r.group, r.prompt, r.total, self.step, self.step + r.decode, self._order,
                                   r.priority)
        self.sum_a += r.total - r.prompt - self.step
        heapq.heappush(self.ends, (self.step + r.decode, self._order, r.tid))

    def _leave(self, tid: int) -> _Seq:
        s = self.running.pop(tid)
        self.sum_a -= s.ctx - s.prompt - s.joined
        self.group_refs[s.group] -= 1
        if not self.group_refs[s.group]:
            self.group_kv -= s.prompt
        return s

    def _evict_for(self, need: int, keep: int | None = None) -> bool:
        """Evict LRU prefix-cache entries until `need` more tokens fit; False if they cannot."""
        while self.kv + self.cached_kv + need > self.hw.capacity:
            victim = next((t for t in self.cached if t != keep), None)
            if victim is None:
                return False
            self.cached_kv -= self.cached.pop(victim)
            self.evictions += 1
        return True

    def submit(self, r: _Req) -> None:
        self._arrivals += 1
        r.arrival = self._arrivals
        if not self.by_priority:
            self.waiting.append(r)
            return
        keys = [(q.priority, q.arrival) for q in self.waiting]
        self.waiting.insert(bisect.bisect(keys, (r.priority, r.arrival)), r)

    def admit(self) -> None:
        """FCFS from the waiting queue while max_num_seqs and KV allow, keeping room for one step of the batch
        (head-of-line blocking); then make room for the next step (evict, or preempt the newest)."""
        while self.waiting and len(self.running) < self.hw.max_num_seqs:
            r = self.waiting[0]
            hit = self.cached.get(r.tid, 0)
            present = self.group_refs.get(r.group, 0) > 0
            resp = r.total - r.prompt
            need = resp - hit + (0 if present else r.prompt) + len(self.running) + 1
            if not self._evict_for(need, keep=r.tid) and self.running:
                break
            self.waiting.popleft()
            if r.tid in self.cached:
                self.cached_kv -= self.cached.pop(r.tid)
            prefill = max(1, resp - hit + (0 if present or hit else r.prompt))
            self.prefill_next += prefill
            self.prefilled += prefill
            self.recomputed += max(0, r.computed - r.prompt - hit)  # computed before, evicted or preempted since
            self._join(r)
        while self.running and not self._evict_for(len(self.running)):
            self._preempt_newest()

    def _preempt_newest(self) -> None:
        """FCFS: the newest admitted goes back to the front of the queue; priority: the largest (priority, order)
        goes back in priority order."""
        s = self._leave(max(self.running.values(), key=lambda q: (q.priority * self.by_priority, q.order)).tid)
        ctx = s.ctx + self.step - s.joined
        r = _Req(s.tid, s.group, s.prompt, ctx, ctx, s.end - self.step, s.priority)
        if self.by_priority:
            self.submit(r)
        else:
            self.waiting.appendleft(r)
        self.preemptions += 1

    def steps_to_next_event(self) -> int | None:
        """Steps until a turn ends or KV runs out (None: idle)."""
        n = len(self.running)
        if n == 0:
            return None
        if self.prefill_next:
            return 1
        while self.running.get(self.ends[0][2]) is None or self.running[self.ends[0][2]].order != self.ends[0][1]:
            heapq.heappop(self.ends)  # a preempted sequence's old entry
        free = self.hw.capacity - self.kv - self.cached_kv
        return max(1, min(self.ends[0][0] - self.step, free // n))

    def time_for(self, k: int) -> float:
        """Seconds for the next k steps: with a pending prefill, one step carrying it; otherwise closed form (the
        batch is constant, its KV grows by n a step)."""
        hw, n = self.hw, len(self.running)
        if self.prefill_next:
            return hw.step_time(n, self.kv, self.prefill_next)
        a, b, c = hw.weights_s + hw.kv_s * self.kv, hw.kv_s * n, hw.dec_s * n  # step j costs t0 + max(a + b j, c)
        j0 = 0 if a >= c else min(k, math.ceil((c - a) / b) if b > 0 else k)  # steps where compute dominates
        mem = (k - j0) * a + b * (k * (k - 1) - j0 * (j0 - 1)) / 2
        return k * hw.t0 + j0 * c + mem

    def steps_until(self, dt: float, k_max: int) -> int:
        """Fewest steps (<= k_max) whose time reaches dt."""
        lo, hi = 1, k_max
        while lo < hi:
            mid = (lo + hi) // 2
            if self.time_for(mid) >= dt:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def advance(self, k: int) -> list[int]:
        """Run k steps (one, if a prefill is pending); returns trajectories whose turn ended."""
        n = len(self.running)
        k = 1 if self.prefill_next else k
        dt = self.time_for(k)
        self.prefill_next = 0
        self.clock += dt
        self.busy_s += dt
        self.batch_s += n * dt
        self.step += k
        self.decoded += n * k
        done = []
        while self.ends and self.ends[0][0] <= self.step:
            _, order, tid = heapq.heappop(self.ends)
            s = self.running.get(tid)
            if s is not None and s.order == order:
                done.append(tid)
        return done

    def finish_turn(self, tid: int, keep_cache: bool) -> None:
        s = self._leave(tid)
        if keep_cache:  # waiting on a tool: its KV stays as evictable prefix cache
            size = s.ctx + (self.step - s.joined) - s.prompt
            self.cached[tid] = size
            self.cached_kv += size


# ---- one step of rollouts ------------------------------------------------------------------------------------
@dataclass
class SimResult:
    policy: str
    makespan_s: float
    after_p95_s: float
    idle_frac: float
    decoded: int
    recomputed: int
    preemptions: int
    evictions: int
    mean_batch: float
    busy_s: list[float] = field(default_factory=list)
    queue_wait_mean_s: float = 0.0

    @property
    def recompute_frac(self) -> float:
        return self.recomputed / max(1, self.decoded)

    def row(self) -> dict:
        return {"policy": self.policy, "makespan_s": round(self.makespan_s, 2),
                "after_p95_s": round(self.after_p95_s, 2), "idle_frac": round(self.idle_frac, 4),
                "recompute_frac": round(self.recompute_frac, 4),
                "preemptions": self.preemptions, "evictions": self.evictions, "mean_batch": round(self.mean_batch, 1),
                "queue_wait_mean_s": round(self.queue_wait_mean_s, 2)}


def simulate(wl: Workload, hw: Hardware, engines: int, policy: str, cfg: SchedulerCfg,
             estimator: LengthEstimator | None = None) -> SimResult:
    """One rollout step of workload `wl` on `engines` identical engines under `policy` (a name in SIM_POLICIES),
    through the same SchedulerSession as the agent loop."""
    return _Sim(wl, hw, engines, policy, cfg, estimator).run()


@dataclass(frozen=True)
class Quota:
    """A rollout that ends once `groups` of its groups are complete (a partial rollout): `of[tid]` is the group
    trajectory tid counts toward; a group is complete when all its trajectories in the workload have ended."""
    of: np.ndarray
    groups: int


@dataclass(frozen=True)
class Unfinished:
    """Where a trajectory stood when a partial rollout ended: turns completed, the response tokens they hold (tool
    outputs included), and the tokens of its current turn decoded so far."""
    tid: int
    turn: int
    response: int
    decoded: int


def simulate_until(wl: Workload, hw: Hardware, engines: int, policy: str, cfg: SchedulerCfg, quota: Quota,
                   estimator: LengthEstimator | None = None) -> tuple[SimResult, list[Unfinished], list[int]]:
    """`simulate` that stops when `quota` is met: its result (makespan: the stop), the trajectories still running
    or waiting then, and the ones that ended. A trajectory waiting on a tool counts its tool call as done."""
    sim = _Sim(wl, hw, engines, policy, cfg, estimator, quota)
    res = sim.run()
    return res, sim.unfinished(), sim.ended


class _Sim:
    """The event loop of `simulate`: engine events (a turn ends, KV runs out) and tool replies, in time order."""

    ENGINE, TOOL_BACK = 0, 1

    def __init__(self, wl: Workload, hw: Hardware, engines: int, policy: str, cfg: SchedulerCfg,
                 estimator: LengthEstimator | None, quota: Quota | None = None):
        self.wl, self.hw, self.policy, self.quota = wl, hw, policy, quota
        self.left = {} if quota is None else dict(zip(*np.unique(quota.of, return_counts=True)))  # group -> running
        self.complete, self.stop_t, self.ended = 0, None, []
        self.session = SchedulerSession(Scheduler([hw.capacity] * engines, cfg, SIM_POLICIES[policy], estimator))
        n = len(wl.group)
        resp_total = wl.response_len
        for tid in range(n):
            self.session.submit(tid, str(wl.group[tid]), int(wl.prompt_len[tid]), wl.cap, 0.0,
                                known_len=int(resp_total[tid]))
        self.eng = [SimEngine(hw, self.session.uses_priority) for _ in range(engines)]
        self.turn = np.zeros(n, dtype=int)
        self.resp = np.zeros(n, dtype=int)
        self.events: list[tuple[float, int, int, int, int]] = []  # (time, seq, kind, a, b)
        self.seq = 0
        self.version = [0] * engines
        self.done_times: list[float] = []

    def push(self, t: float, kind: int, a: int, b: int) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, a, b))

    def plan(self, e: int) -> None:
        """(Re)schedule engine e's next internal event."""
        self.version[e] += 1
        k = self.eng[e].steps_to_next_event()
        if k is not None:
            self.push(self.eng[e].clock + self.eng[e].time_for(k), self.ENGINE, e, self.version[e])

    def arrive(self, e: int, req: _Req, t: float) -> None:
        """A request reaches engine e at time t: it joins at the first step boundary at or after t."""
        en = self.eng[e]
        if not en.running:
            en.clock = max(en.clock, t)
        elif en.clock < t and not en.prefill_next:
            k_int = en.steps_to_next_event()
            k = en.steps_until(t - en.clock, k_int)
            if k < k_int:  # otherwise it joins at the internal event, which comes first
                en.advance(k)
        en.submit(req)
        if en.clock >= t:
            en.admit()
        self.plan(e)

    def start(self, t: float) -> None:
        wl = self.wl
        for tid, e in self.session.placements(t):
            p = int(wl.prompt_len[tid])
            self.arrive(e, _Req(tid, int(wl.group[tid]), p, p, 0, wl.decode[tid][0], self.session.priority(tid)), t)

    def run(self) -> SimResult:
        self.start(0.0)
        while self.events and self.stop_t is None:
            t, _, kind, a, b = heapq.heappop(self.events)
            if kind == self.ENGINE:
                if b == self.version[a]:
                    self.engine_event(a)
            else:
                self.tool_back(t, a, b)
        return self.result()

    def engine_event(self, e: int) -> None:
        wl, en = self.wl, self.eng[e]
        ended = en.advance(en.steps_to_next_event())
        t = en.clock
        for tid in ended:
            j = self.turn[tid]
            self.resp[tid] += wl.decode[tid][j]
            last = j == len(wl.decode[tid]) - 1
            en.finish_turn(tid, keep_cache=not last)  # off to a tool: its KV stays as evictable cache
            # what a real engine reports: vLLM counts preemptions, not prefix-cache evictions
            self.session.turn_done(tid, e, t, int(self.resp[tid]), j + 1, END if last else TOOL,
                                   (en.usage, en.preemptions))
            if last:
                self.done_times.append(t)
                self._ended(tid, t)
            else:
                self.push(t + wl.tool_s[tid][j], self.TOOL_BACK, tid, e)
        en.admit()
        self.plan(e)
        if ended:
            self.start(t)

    def _ended(self, tid: int, t: float) -> None:
        self.ended.append(tid)
        if self.quota is None:
            return
        g = self.quota.of[tid]
        self.left[g] -= 1
        if not self.left[g]:
            self.complete += 1
            if self.complete >= self.quota.groups:
                self.stop_t = t

    def unfinished(self) -> list[Unfinished]:
        """After a stop: every trajectory not ended, with its progress (see Unfinished)."""
        running = {tid: (e, sq) for e, en in enumerate(self.eng) for tid, sq in en.running.items()}
        waiting = {r.tid: r for en in self.eng for r in en.waiting}
        on_tool = {a for _, _, kind, a, _ in self.events if kind == self.TOOL_BACK}
        ended, out = set(self.ended), []
        for tid in range(len(self.wl.group)):
            if tid in ended:
                continue
            j, resp = int(self.turn[tid]), int(self.resp[tid])
            if tid in running:
                e, sq = running[tid]
                decoded = self.wl.decode[tid][j] - max(0, sq.end - self.eng[e].step)
            elif tid in waiting:
                decoded = self.wl.decode[tid][j] - waiting[tid].decode
            elif tid in on_tool:
                resp += self.wl.decode[tid][j] + self.wl.tool_out[tid][j]  # its turn and tool call are done
                j, decoded = j + 1, 0
            else:
                decoded = 0  # not started
            out.append(Unfinished(tid, j, resp, int(decoded)))
        return out

    def tool_back(self, t: float, tid: int, e: int) -> None:
        """A tool result is back: the trajectory's next turn goes to its engine (sticky)."""
        wl = self.wl
        j = self.turn[tid]
        before = int(wl.prompt_len[tid]) + int(self.resp[tid])
        self.resp[tid] += wl.tool_out[tid][j]
        self.turn[tid] = j + 1
        p = int(wl.prompt_len[tid])
        if self.session.tool_done(tid, t, int(self.resp[tid]), j + 1, ended=False):
            self.arrive(e, _Req(tid, int(wl.group[tid]), p, before + wl.tool_out[tid][j], before,
                                wl.decode[tid][j + 1], self.session.priority(tid)), t)

    def result(self) -> SimResult:
        if not self.session.done and self.stop_t is None:
            raise RuntimeError("simulation ended with unfinished trajectories (a scheduler or engine model bug)")
        eng, engines = self.eng, len(self.eng)
        makespan = max(self.done_times) if self.stop_t is None else self.stop_t
        # an engine still decoding at the stop was busy up to it
        busy = [en.busy_s + (max(0.0, makespan - en.clock) if en.running else 0.0) for en in eng]
        summ = self.session.finish() if self.stop_t is None else {"queue_wait_mean_s": 0.0}
        return SimResult(self.policy, makespan, makespan - float(np.quantile(self.done_times, 0.95)),
                         1 - sum(busy) / (engines * makespan), sum(en.decoded for en in eng),
                         sum(en.recomputed for en in eng), sum(en.preemptions for en in eng),
                         sum(en.evictions for en in eng), sum(en.batch_s for en in eng) / (engines * makespan), busy,
                         summ["queue_wait_mean_s"])


def bounds(wl: Workload, hw: Hardware, engines: int) -> dict:
    """Reference figures: the naive work bound (total engine work at full batches / engines) and the longest
    trajectory run alone."""
    dec = [sum(d) for d in wl.decode]
    # Q: sum over decoded tokens of the context they read (prompt + response so far), per trajectory closed form
    q = sum(d * (p + d / 2) for d, p in zip(dec, wl.prompt_len))
    n_dec = sum(dec)
    steps = max(n_dec / hw.max_num_seqs, q / hw.capacity)
    work = max(steps * (hw.t0 + hw.weights_s) + hw.kv_s * q, n_dec * hw.dec_s)
    i = int(np.argmax([sum(d) for d in wl.decode]))
    p = int(wl.prompt_len[i])
    solo = sum(hw.step_time(1, p + x) for x in range(0, sum(wl.decode[i]), 16)) * 16 + sum(wl.tool_s[i])
    return {"work_per_engine_s": work / engines, "longest_solo_s": solo, "lb_s": max(work / engines, solo)}


def warm_estimator(prev: Workload, cfg: SchedulerCfg) -> LengthEstimator:
    """The length estimate kv_aware starts a step with: learned from the previous step's finished trajectories
    (final response length, turns), as in a training run where every step after the first has one."""
    est = LengthEstimator(cfg.estimator_window, cfg.prior_frac)
    for r, t in zip(prev.response_len, prev.turns):
        est.observe(int(r), int(t))
    est.commit()
    return est


# ---- scenarios and the sweep behind `rstar2 bench rollout` ---------------------------------------------------
@dataclass(frozen=True)
class Scenario:
    name: str
    engines: int
    prompts: int
    stage: str
    capacity: int
    tools: str = "base"
    samples: int = 32


def scenarios(engines: int = 64, prompts: int = 512) -> list[Scenario]:
    """The issue's grid at a given scale (paper: 64 engines, 512 prompts x 32): 8K and 12K budgets, generous
    (750K tokens, bf16 KV on a 192 GB GPU) and tight (250K / 400K) KV, slow and fast tools."""
    s = lambda name, stage, cap, tools="base": Scenario(name, engines, prompts, stage, cap, tools)  # noqa: E731
    return [s("s1_8K_C750K", "s1", 750_000), s("s1_8K_C250K", "s1", 250_000),
            s("s1_8K_C750K_slowtool", "s1", 750_000, "slow"), s("s1_8K_C750K_fasttool", "s1", 750_000, "fast"),
            s("s2_12K_C750K", "s2", 750_000), s("s3_12K_C750K", "s3", 750_000), s("s3_12K_C400K", "s3", 400_000)]


BENCH_POLICIES = ("oracle", "oracle_static", "static", "round_robin", "least_requests", "kv_aware")  # in tables


def run_scenario(sc: Scenario, seed: int, icc_value: float, cfg: SchedulerCfg,
                 policies: tuple[str, ...] = BENCH_POLICIES) -> list[dict]:
    """Every policy on one seed's workload (and the same previous step for kv_aware's length estimate)."""
    spec = WorkloadSpec(sc.prompts, sc.samples, STAGES[sc.stage], icc_value, TOOLS[sc.tools])
    wl = make_workload(spec, np.random.default_rng(seed))
    prev = make_workload(spec, np.random.default_rng(10_000 + seed))
    hw = Hardware(capacity=sc.capacity)
    b = bounds(wl, hw, sc.engines)
    rows = []
    for p in policies:
        r = simulate(wl, hw, sc.engines, p, cfg, warm_estimator(prev, cfg))
        rows.append({"scenario": sc.name, "seed": seed, **r.row(), "naive_bound_s": round(b["lb_s"], 2)})
    return rows


def sweep(grid: list[Scenario], seeds: int, icc_value: float, cfg: SchedulerCfg, workers: int = 1,
          on_done=None, policies: tuple[str, ...] = BENCH_POLICIES) -> list[dict]:
    """Every scenario x seed (each a separate process when workers > 1: a paper-scale step takes seconds to a
    minute per policy); rows in a fixed order whatever the completion order."""
    from concurrent.futures import ProcessPoolExecutor
    from itertools import repeat

    jobs = [(sc, seed) for sc in grid for seed in range(seeds)]
    pool = ProcessPoolExecutor(workers) if workers > 1 else None
    try:
        results = (pool.map if pool else map)(run_scenario, [sc for sc, _ in jobs], [seed for _, seed in jobs],
                                              repeat(icc_value), repeat(cfg), repeat(policies))
        out = []
        for (sc, seed), rows in zip(jobs, results):
            out.extend(rows)
            if on_done:
                on_done(sc, seed)
        return out
    finally:
        if pool:
            pool.shutdown()


def summarize(rows: list[dict]) -> list[dict]:
    """Per scenario and policy: median makespan over seeds, and the medians of the per-seed ratios the issue's
    bar is stated in (x oracle, x the best schedule found in that seed by any policy, static / this, this /
    round_robin and least_requests)."""
    out = []
    for sc in dict.fromkeys(r["scenario"] for r in rows):
        by_seed: dict[int, dict[str, dict]] = {}
        for r in rows:
            if r["scenario"] == sc:
                by_seed.setdefault(r["seed"], {})[r["policy"]] = r
        for p in dict.fromkeys(r["policy"] for r in rows if r["scenario"] == sc):
            seeds = [d for d in by_seed.values() if p in d]
            ms = np.array([d[p]["makespan_s"] for d in seeds])

            def ratio(other):
                if not all(other in d for d in seeds):
                    return None
                return float(np.median([d[p]["makespan_s"] / d[other]["makespan_s"] for d in seeds]))

            best = [min(r["makespan_s"] for r in d.values()) for d in seeds]
            out.append({"scenario": sc, "policy": p, "seeds": len(seeds), "makespan_s": float(np.median(ms)),
                        "x_oracle": ratio("oracle"),
                        "x_best": float(np.median([d[p]["makespan_s"] / b for d, b in zip(seeds, best)])),
                        "x_best_max": float(max(d[p]["makespan_s"] / b for d, b in zip(seeds, best))),
                        "x_round_robin": ratio("round_robin"),
                        "x_least_requests": ratio("least_requests"),
                        "static_speedup": 1 / ratio("static") if ratio("static") else None,
                        "x_naive_bound": float(np.median([d[p]["makespan_s"] / d[p]["naive_bound_s"] for d in seeds])),
                        **{k: float(np.median([d[p][k] for d in seeds]))
                           for k in ("idle_frac", "recompute_frac", "preemptions", "evictions", "mean_batch",
                                     "queue_wait_mean_s")}})
    return out


SHIPPED_LENGTHS = str(Path(__file__).parent / "data" / "rollout" / "lengths.parquet")


def measured_icc(paths: list[str]) -> dict:
    """Within-prompt correlation of response lengths in real rollout tables (runs/<run>/stage*/step-*/
    rollouts.parquet): groups are (file, problem_id), so each step's rollouts of a prompt form one group.
    SHIPPED_LENGTHS holds the lengths of 14,592 real rollouts from four tiny-world runs (the campaign, a re-run,
    the plain-GRPO ablation, the three-stage campaign), with problem ids prefixed by run/stage/step."""
    import polars as pl

    if not paths:
        raise ValueError("no rollout tables given: run a campaign first (runs/<run>/stage*/step-*/rollouts.parquet)")
    df = pl.concat([pl.read_parquet(p, columns=["problem_id", "response_len", "num_turns"])
                    .with_columns(pl.lit(i).alias("file")) for i, p in enumerate(paths)])
    groups = (df["file"].cast(pl.Utf8) + "/" + df["problem_id"].cast(pl.Utf8)).to_list()
    return {"icc": icc(groups, df["response_len"].to_list()), "rollouts": df.height,
            "groups": len(set(groups)), "files": len(paths),
            "mean_response_len": float(df["response_len"].mean()), "mean_turns": float(df["num_turns"].mean())}


def compare(engines: int, prompts: int, seeds: int, scenario: list[str], rollouts: str, icc_value: float | None,
            workers: int, policies: list[str], extend: Path | None, say: Callable[..., None] = print) -> dict:
    """`rstar2 bench rollout`'s simulated half: every policy on every scenario x seed, with the within-prompt length
    correlation measured on the rollout tables `rollouts` matches (none: SHIPPED_LENGTHS) unless `icc_value` is given;
    `extend`: an earlier --json of the command whose simulated runs are kept beside the new ones. Bad input: one
    ValueError naming it."""
    unknown = set(policies) - set(BENCH_POLICIES)
    if unknown:
        raise ValueError(f"unknown policy {sorted(unknown)}; choose from {', '.join(BENCH_POLICIES)}")
    measured = None
    if icc_value is None:
        paths = sorted(glob.glob(rollouts)) or [SHIPPED_LENGTHS]
        measured = measured_icc(paths)
        icc_value = measured["icc"]
        say(f"within-prompt length correlation (ICC) measured on {measured['rollouts']} real rollouts "
            f"({measured['groups']} prompt groups, {', '.join(paths[:2])}{' ...' if len(paths) > 2 else ''})"
            f": {icc_value:.3f}")
    grid = [s for s in scenarios(engines, prompts) if not scenario or s.name in scenario]
    if not grid:
        raise ValueError(f"no scenario named {scenario}; choose from {', '.join(s.name for s in scenarios())}")
    rows = sweep(grid, seeds, icc_value, SchedulerCfg(), workers,
                 on_done=lambda sc, seed: say(f"  {sc.name} seed {seed} done", style="dim"),
                 policies=tuple(policies) or BENCH_POLICIES)
    if extend:  # same scenarios, seeds and correlation: the simulation is deterministic given them
        try:
            old = json.loads(extend.read_text())["sim"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{extend} is not a --json of `rstar2 bench rollout` with simulated runs") from None
        if (old["engines"], old["prompts"], round(old["icc"], 6)) != (engines, prompts, round(icc_value, 6)):
            raise ValueError(f"{extend} was simulated with other engines/prompts/ICC")
        new = {(r["scenario"], r["seed"], r["policy"]) for r in rows}
        rows = [r for r in old["runs"] if (r["scenario"], r["seed"], r["policy"]) not in new] + rows
    return {"engines": engines, "prompts": prompts, "seeds": seeds, "icc": icc_value, "icc_measured": measured,
            "summary": summarize(rows), "runs": rows}
