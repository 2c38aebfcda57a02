"""Multi-turn agent loop (paper §2.1, implementation notes §4.3, §12.1).

Token-in/token-out: each trajectory is the prompt ids plus a response built turn by turn. Model tokens get loss mask
1; tool turns (`<tool_response>` + the re-opened assistant `<reason>`) get loss mask 0. A turn with a tool call runs
the first call in the sandbox (a broken call becomes a parse-error tool response, as in the paper); a turn without
one ends the trajectory. Tool tokens count against the response budget, and a trajectory never ends on a tool turn:
if the tool turn would not fit, or the turn limit is reached, it stops as truncated (reward 0).

`run` advances all live trajectories one turn at a time (a barrier per turn; evaluation uses it). `run_scheduled`,
the RL step's rollout, has no barrier: rstar2.scheduler places each trajectory on one engine (sticky), and each
trajectory's next turn is submitted to its engine the moment it is ready (placed, or its tool reply in); the engine
batches whatever is in flight (continuous batching, rstar2.engine) and every turn comes back on its own. Tool calls
run concurrently, so one trajectory's sandbox time overlaps the others' generation. An engine that fails, or hangs
(no probe answer / no progress for `hang_timeout_s`), has its trajectories requeued to the others; they resume from
their last completed turn, and a late answer from the dead engine is never applied.

With a seed, every trajectory-turn samples from a seed of its own (`Trajectory.turn_seed`: the run's seed, problem,
sample and turn), so the rollout is a function of the seed and the weights: the same whatever the policy, the
engine count, the timing or an engine failure (as far as the engine's arithmetic does not depend on the batch).
"""

from __future__ import annotations

import queue
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np

from rstar2 import template as T
from rstar2.config import SchedulerCfg
from rstar2.sandbox import ExecRequest, ExecResult
from rstar2.scheduler import RUNNING, LengthEstimator, Scheduler
from rstar2.tool_parser import format_tool_response, parse_tool_calls, tool_call_to_request

# generate(prompts, max_tokens, seeds) -> [(new_ids, finish_reason)], one assistant turn per prompt
GenerateFn = Callable[[list[list[int]], list[int], list[int | None]], list[tuple[list[int], str]]]


class Sandbox(Protocol):
    def run_batch(self, reqs: list[ExecRequest]) -> list[ExecResult]: ...


@dataclass
class RolloutLimits:
    max_turns: int = 10
    max_response_tokens: int = 8192
    tool_response_chars: int = 256
    max_model_len: int | None = None  # the engine's context: caps prompt + response


@dataclass
class Trajectory:
    problem_id: str
    sample_idx: int
    gold: str
    prompt_ids: list[int]
    budget: int  # response tokens allowed, tool turns included
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    tool_statuses: list[str] = field(default_factory=list)
    tool_wall_s: list[float] = field(default_factory=list)
    assistant_turns: list[str] = field(default_factory=list)
    truncated: bool = False
    done: bool = False
    seed: int | None = None  # its turns' seeds derive from it (turn_seed); None: the engine's own random stream

    @property
    def num_turns(self) -> int:
        return len(self.assistant_turns)

    def turn_seed(self, turn: int | None = None) -> int | None:
        """The next turn's (or model turn `turn`'s) sampling seed: a function of the trajectory and the turn alone,
        so its tokens do not depend on which engine runs it, when, or beside which others (the scheduled rollout's
        order is timing)."""
        k = self.num_turns if turn is None else turn
        return None if self.seed is None else zlib.crc32(f"{self.seed}/{k}".encode())

    def turn_requests(self) -> list[tuple[list[int], int, int | None]]:
        """Its model turns as the agent loop sent them, (context, max_tokens, seed) each: a model turn starts where
        the loss mask turns to 1 (tool tokens are 0). For a replay without tools (rstar2.engine)."""
        starts = [i for i, m in enumerate(self.loss_mask) if m and (i == 0 or not self.loss_mask[i - 1])]
        return [(self.prompt_ids + self.response_ids[:i], self.budget - i, self.turn_seed(k))
                for k, i in enumerate(starts)]


@dataclass
class _Pending:
    traj: Trajectory
    reply: str | None = None  # tool response text, when known without running code
    request: ExecRequest | None = None


def _after_turn(traj: Trajectory, text: str, finish: str, limits: RolloutLimits) -> _Pending | None:
    """Decide what follows an assistant turn: nothing (done), or a tool reply (known now or after execution)."""
    if finish == "length" or len(traj.response_ids) >= traj.budget:
        traj.truncated = traj.done = True
        return None
    parsed = parse_tool_calls(text)
    if parsed.error is None and not parsed.calls:
        traj.done = True  # a turn without a tool call is the final answer
        return None
    if traj.num_turns >= limits.max_turns:
        traj.truncated = traj.done = True
        return None
    if parsed.error is not None:
        traj.tool_statuses.append("parse_error")
        traj.tool_wall_s.append(0.0)
        return _Pending(traj, reply=parsed.error)
    req = tool_call_to_request(parsed.calls[0])  # max_parallel_calls = 1, as released
    if isinstance(req, str):
        traj.tool_statuses.append("error")
        traj.tool_wall_s.append(0.0)
        return _Pending(traj, reply=req)
    return _Pending(traj, request=req)


def make_trajs(tokenizer, problems: list[dict], n_samples: int, limits: RolloutLimits,
               seed: int | str | None = None) -> list[Trajectory]:
    """`n_samples` trajectories per problem; with `seed`, trajectory k of a problem samples from a seed of its own
    (derived from seed, problem id and k)."""
    trajs: list[Trajectory] = []
    for p in problems:
        prompt_ids = tokenizer(T.build_prompt(p["prompt"]), add_special_tokens=False)["input_ids"]
        budget = limits.max_response_tokens
        if limits.max_model_len:
            budget = min(budget, limits.max_model_len - len(prompt_ids))
        if budget <= 0:
            raise ValueError(f"problem {p['problem_id']}: prompt of {len(prompt_ids)} tokens leaves no room to answer")
        trajs += [Trajectory(p["problem_id"], k, str(p["answer"]), prompt_ids, budget,
                             seed=None if seed is None else zlib.crc32(f"{seed}/{p['problem_id']}/{k}".encode()))
                  for k in range(n_samples)]
    return trajs


def _model_turn(t: Trajectory, ids: list[int], finish: str, tokenizer, limits: RolloutLimits) -> _Pending | None:
    t.response_ids += ids
    t.loss_mask += [1] * len(ids)
    text = tokenizer.decode(ids, skip_special_tokens=False)
    t.assistant_turns.append(text)
    return _after_turn(t, text, finish, limits)


def _tool_result(p: _Pending, res: ExecResult, limits: RolloutLimits) -> None:
    p.traj.tool_statuses.append(res.status)
    p.traj.tool_wall_s.append(res.wall_s)
    p.reply = format_tool_response(res, limits.tool_response_chars)


def _tool_turn(p: _Pending, tokenizer) -> bool:
    """Append the tool reply (loss mask 0); False (and truncated) if it would not fit: never end on a tool turn."""
    ids = tokenizer(T.tool_turn(p.reply), add_special_tokens=False)["input_ids"]
    if len(p.traj.response_ids) + len(ids) >= p.traj.budget:
        p.traj.truncated = p.traj.done = True
        return False
    p.traj.response_ids += ids
    p.traj.loss_mask += [0] * len(ids)
    return True


def run(generate: GenerateFn, sandbox: Sandbox, tokenizer, problems: list[dict], n_samples: int,
        limits: RolloutLimits, on_turn: Callable[[int, int], None] | None = None,
        seed: int | str | None = None) -> list[Trajectory]:
    """Roll out `n_samples` trajectories per problem (dicts with problem_id, prompt, answer), turn by turn."""
    trajs = make_trajs(tokenizer, problems, n_samples, limits, seed)
    turn = 0
    while live := [t for t in trajs if not t.done]:
        budgets = [t.budget - len(t.response_ids) for t in live]
        outs = generate([t.prompt_ids + t.response_ids for t in live], budgets, [t.turn_seed() for t in live])
        pending = [nxt for t, (ids, finish) in zip(live, outs)
                   if (nxt := _model_turn(t, ids, finish, tokenizer, limits)) is not None]
        to_run = [p for p in pending if p.request is not None]
        for p, res in zip(to_run, sandbox.run_batch([p.request for p in to_run]) if to_run else []):
            _tool_result(p, res, limits)
        for p in pending:
            _tool_turn(p, tokenizer)
        turn += 1
        if on_turn:
            on_turn(turn, len(live))
    return trajs


class EngineClient(Protocol):
    """One engine as run_scheduled drives it (rstar2.cluster.EngineClient for a vLLM engine actor)."""

    def submit(self, prompt: list[int], max_tokens: int, seed: int | None = None, priority: int = 0) -> Future:
        """One trajectory-turn; the future resolves to (new ids, finish reason, the engine's stats after it).
        priority: the engine's (vLLM's: lower runs first and is preempted last)."""

    def probe(self) -> Future:
        """The engine's stats: kv_usage (fraction of KV blocks in use), preemptions (cumulative), steps (engine
        iterations so far: its progress)."""


@dataclass
class _Watch:
    """The agent loop's view of one engine during a rollout: turns in flight, liveness, vLLM's stats."""
    inflight: int = 0
    busy_since: float | None = None
    busy_s: float = 0.0
    progress_at: float = 0.0  # last sign of progress: a turn came back or its step counter moved
    steps: int = -1
    probe: Future | None = None
    probe_sent: float = float("-inf")
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

    def stats(self, s: dict) -> None:
        self.usage.append(float(s["kv_usage"]))
        self.peak_waiting = max(self.peak_waiting, int(s.get("waiting", 0)))
        p = int(s["preemptions"])
        self.preemptions = (p, p) if self.preemptions is None else (self.preemptions[0], max(p, self.preemptions[1]))


class _Outstanding(dict):
    """Futures in flight -> what they are. Each one reports to a queue when it completes, so the agent loop waits on
    that queue: O(1) per event, where `concurrent.futures.wait` re-arms every outstanding future each time (hundreds
    of turns in flight, an event per turn)."""

    def __init__(self):
        super().__init__()
        self._done: queue.SimpleQueue = queue.SimpleQueue()

    def __setitem__(self, fut: Future, what: tuple) -> None:
        super().__setitem__(fut, what)
        fut.add_done_callback(self._done.put)

    def completed(self, timeout: float) -> list[Future]:
        """The futures completed since the last call (waits up to `timeout` for a first one); some may have been
        dropped from the map meanwhile (abandoned with a dead engine): the caller skips those."""
        try:
            out = [self._done.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out


def run_scheduled(engines: list[EngineClient], capacities: list[int], cfg: SchedulerCfg, sandbox: Sandbox, tokenizer,
                  problems: list[dict], n_samples: int, limits: RolloutLimits, policy: str | None = None,
                  on_done: Callable[[int, int], None] | None = None,
                  estimator: LengthEstimator | None = None,
                  seed: int | str | None = None) -> tuple[list[Trajectory], dict]:
    """Roll out through the scheduler (see module docstring). `estimator`: kv_aware's length model, carried over
    from the previous steps (it learns from their finished trajectories); a fresh one starts from a prior. engines[e] takes one trajectory-turn at a time and
    batches whatever is in flight (continuous batching); capacities[e] is its KV capacity in tokens. A turn is
    submitted the moment its trajectory is ready (placed, or its tool reply in); tool calls run in a thread pool.

    Every `cfg.probe_interval_s` each engine is probed; an engine that fails a turn, leaves a probe unanswered,
    or has turns in flight but makes no progress (its step counter stands still) for `cfg.hang_timeout_s` is
    dead: `sched.engine_failed` requeues its trajectories, which resume from their last completed turn elsewhere,
    and whatever it answers later is ignored (a turn is applied at most once). Returns the trajectories and the
    step's scheduling metrics (per engine: busy share, KV usage mean/max, preemptions; queue wait, tool wait,
    requeues, engine failures). With `seed`, each turn samples from its own seed (Trajectory.turn_seed): the
    trajectories are the same whatever the policy, placement or timing."""
    trajs = make_trajs(tokenizer, problems, n_samples, limits, seed)
    sched = Scheduler(capacities, cfg, policy, estimator, max(getattr(e, "block_size", 1) for e in engines))
    t0 = time.perf_counter()
    now = lambda: time.perf_counter() - t0  # noqa: E731
    for i, t in enumerate(trajs):
        sched.submit(i, t.problem_id, len(t.prompt_ids), t.budget, 0.0)
    watch = [_Watch() for _ in engines]
    futs = _Outstanding()  # what each outstanding future is: ("gen", e, tid) | ("tool", e, pending) | ("probe", e)
    at_tool: set[int] = set()  # waiting on the sandbox: its next turn is sent once the reply is in
    tool_waits: list[float] = []
    failures: list[dict] = []
    finished = 0

    def fail(e: int, why: str) -> None:
        failures.append({"engine": e, "at_s": round(now(), 3), "error": why[:200]})
        for f in [f for f, what in futs.items() if what[0] != "tool" and what[1] == e]:
            del futs[f]  # abandoned: a late answer from a dead engine is never applied
        w = watch[e]
        if w.busy_since is not None:
            w.busy_s += now() - w.busy_since
        w.inflight, w.busy_since, w.probe = 0, None, None
        sched.engine_failed(e, now())

    def observe(e: int, stats: dict) -> None:
        watch[e].stats(stats)
        sched.observe_engine(e, now(), float(stats["kv_usage"]), int(stats["preemptions"]))

    def send(tid: int) -> None:
        tv = sched.trajs[tid]
        if tv.state != RUNNING:  # its engine failed while this turn was being placed
            return
        t, e = trajs[tid], tv.engine
        try:
            f = engines[e].submit(t.prompt_ids + t.response_ids, t.budget - len(t.response_ids), t.turn_seed(),
                                  sched.priority(tid))
        except Exception as err:  # noqa: BLE001 - a dead engine: requeue, the batch completes
            return fail(e, repr(err))
        futs[f] = ("gen", e, tid)
        watch[e].turn_sent(now())

    def end(tid: int) -> None:
        nonlocal finished
        report(tid)  # its final length and turns: what the length estimate learns
        sched.release(tid, "finished", now())
        finished += 1
        if on_done:
            on_done(finished, len(trajs))

    def report(tid: int) -> None:
        """The trajectory's length and turns so far, as its turn or tool reply comes in (if it still runs: not if
        its engine failed meanwhile and it waits in the queue)."""
        if sched.trajs[tid].state == RUNNING:
            t = trajs[tid]
            sched.progress(tid, len(t.response_ids), t.num_turns)

    def next_turn(tid: int) -> None:
        report(tid)
        sched.at_tool(tid, False)
        send(tid)

    def probe_all() -> None:
        for e, w in enumerate(watch):
            if sched.engines[e].alive and w.probe is None and now() - w.probe_sent >= cfg.probe_interval_s:
                try:
                    w.probe, w.probe_sent = engines[e].probe(), now()
                except Exception as err:  # noqa: BLE001
                    fail(e, repr(err))
                    continue
                futs[w.probe] = ("probe", e)

    def check_hangs() -> None:
        for e, w in enumerate(watch):
            if not sched.engines[e].alive:
                continue
            if w.probe is not None and now() - w.probe_sent > cfg.hang_timeout_s:
                fail(e, f"hang: no answer to a probe for {cfg.hang_timeout_s} s")
            elif w.inflight and now() - w.progress_at > cfg.hang_timeout_s:
                fail(e, f"hang: {w.inflight} turns in flight and no progress for {cfg.hang_timeout_s} s")

    # a first probe of every engine: its stats before the rollout (the preemption baseline); no answer = dead
    probe_all()
    wait([f for f, what in futs.items()], timeout=cfg.hang_timeout_s)
    with ThreadPoolExecutor(max_workers=32, thread_name_prefix="rollout-tool") as pool:
        while not sched.done:
            placed = -1
            while placed != len(failures):  # a submit that failed requeued its engine's trajectories: place again
                placed = len(failures)
                for tid, e in sched.dispatch(now()):
                    if tid in at_tool:  # requeued after an engine failure while at a tool: its turn goes in later
                        sched.at_tool(tid, True)
                    else:
                        send(tid)
            probe_all()
            if all(what[0] == "probe" for what in futs.values()):
                raise RuntimeError("rollout stalled: trajectories left but nothing running (a scheduler bug)")
            done = futs.completed(timeout=cfg.probe_interval_s)
            for f in done:
                what = futs.pop(f, None)
                if what is None:
                    continue  # abandoned when its engine was declared dead in this same round
                kind, e = what[0], what[1]
                if kind == "probe":
                    watch[e].probe = None
                    try:
                        stats = f.result()
                    except Exception as err:  # noqa: BLE001
                        fail(e, repr(err))
                        continue
                    if stats["steps"] != watch[e].steps:
                        watch[e].steps, watch[e].progress_at = stats["steps"], now()
                    observe(e, stats)
                elif kind == "tool":
                    p = what[2]
                    tid = what[3]
                    tool_waits.append(now() - what[4])
                    at_tool.discard(tid)
                    _tool_result(p, f.result()[0], limits)
                    if not _tool_turn(p, tokenizer):
                        end(tid)
                    elif sched.trajs[tid].state == RUNNING:  # else requeued after its engine failed: placed later
                        next_turn(tid)
                else:
                    tid = what[2]
                    watch[e].turn_back(now())
                    try:
                        ids, finish, stats = f.result()
                    except Exception as err:  # noqa: BLE001 - a dead or broken engine: requeue, the batch completes
                        fail(e, repr(err))
                        continue
                    p = _model_turn(trajs[tid], ids, finish, tokenizer, limits)
                    if p is not None and p.request is not None:
                        report(tid)  # its KV now holds this turn's tokens, while it waits on the sandbox
                        sched.at_tool(tid, True)  # before the stats: vLLM's usage no longer counts its KV
                    observe(e, stats)
                    if p is None:
                        end(tid)
                    elif p.request is None:
                        next_turn(tid) if _tool_turn(p, tokenizer) else end(tid)
                    else:
                        at_tool.add(tid)
                        futs[pool.submit(sandbox.run_batch, [p.request])] = ("tool", e, p, tid, now())
            check_hangs()
    wall = now()
    summ = sched.summary()
    sched.estimator.commit()
    per_engine: dict = {}
    for e, w in enumerate(watch):
        if w.busy_since is not None:
            w.busy_s += wall - w.busy_since
        pre = w.preemptions[1] - w.preemptions[0] if w.preemptions else 0
        per_engine.update({f"sched_engine{e}_busy": w.busy_s / max(wall, 1e-9),
                           f"sched_engine{e}_dispatched": summ["dispatched_per_engine"][e],
                           f"sched_engine{e}_kv_usage_mean": float(np.mean(w.usage)) if w.usage else 0.0,
                           f"sched_engine{e}_kv_usage_max": max(w.usage, default=0.0),
                           f"sched_engine{e}_preemptions": pre,
                           f"sched_engine{e}_peak_inflight": w.peak_inflight,
                           f"sched_engine{e}_peak_waiting": w.peak_waiting})
    return trajs, {"rollout_wall_s": wall, "sched_policy": summ["policy"],
                   "sched_queue_wait_mean_s": summ["queue_wait_mean_s"], "sched_queue_wait_p95_s": summ["queue_wait_p95_s"],
                   "sched_requeued": summ["requeued"], "sched_engine_failures": len(failures),
                   "sched_tool_wait_s": float(sum(tool_waits)),
                   "sched_tool_wait_mean_s": float(np.mean(tool_waits)) if tool_waits else 0.0,
                   "sched_preemptions": sum(v for k, v in per_engine.items() if k.endswith("_preemptions")),
                   "sched_failures": failures, **per_engine}


def to_rows(trajs: list[Trajectory], tokenizer) -> list[dict]:
    """Flat records for the rollout Parquet table (one row per trajectory)."""
    return [dict(
        problem_id=t.problem_id, sample_idx=t.sample_idx, gold=t.gold, prompt_ids=t.prompt_ids,
        response_ids=t.response_ids, loss_mask=t.loss_mask, tool_statuses=t.tool_statuses,
        tool_wall_s=t.tool_wall_s, num_tool_calls=len(t.tool_statuses), num_turns=t.num_turns,
        truncated=t.truncated, response_len=len(t.response_ids),
        assistant_text="\n".join(t.assistant_turns), final_text=t.assistant_turns[-1] if t.assistant_turns else "",
        response_text=tokenizer.decode(t.response_ids, skip_special_tokens=False),
    ) for t in trajs]
