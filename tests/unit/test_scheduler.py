"""Invariants of rstar2.rollout.scheduler under random protocol traffic (every policy, the simulator's oracles
included): never over budget, sticky, exactly once (also after engine failures), release on error/cancel frees the
engine; the SchedulerSession's protocol on hand-worked event sequences; and the simulator conserves work."""

import numpy as np
import pytest

from rstar2.bench.rollout_sim import SIM_POLICIES, STAGES, Hardware, WorkloadSpec, icc, make_workload, simulate
from rstar2.core.config import SchedulerCfg
from rstar2.rollout.estimator import LengthEstimator
from rstar2.rollout.scheduler import END, TOOL, TURN, Scheduler, SchedulerError, SchedulerSession

CFG = SchedulerCfg(max_inflight=8, oversubscribe=1.0, probes_per_prompt=1)


def _drive(policy: str, seed: int, fail_at: int | None = None):
    """Random traffic: 6 prompts x 5 rollouts on 3 engines; turns grow lengths; some end in error/cancel."""
    rng = np.random.default_rng(seed)
    s = Scheduler([4000, 4000, 4000], CFG, SIM_POLICIES[policy])
    known = {}
    for tid in range(30):
        known[tid] = int(rng.integers(50, 1500))
        s.submit(tid, f"p{tid // 5}", 100, 1500, 0.0, known_len=known[tid])
    where, released, now, events = {}, [], 0.0, 0
    running: set[int] = set()
    while not s.done:
        now += 1.0
        picks = s.dispatch(now)
        for tid, e in picks:
            assert tid not in running and e is not None
            where[tid] = e
            running.add(tid)
        # never over budget: an engine that admitted now holds at most its budget (expected peak for kv_aware,
        # true future KV for oracle), unless it runs that one alone
        if policy in ("kv_aware", "oracle"):
            for e in {e for _, e in picks}:
                v = s.engines[e]
                assert len(v.inflight) <= 1 or v.peak <= v.budget + 1e-6
        for v in s.engines:
            assert len(v.inflight) <= CFG.max_inflight or policy in ("static", "round_robin", "oracle_static")
        events += 1
        if fail_at is not None and events == fail_at:
            dead = next(i for i, v in enumerate(s.engines) if v.inflight)
            back = s.engine_failed(dead, now)
            assert back and all(s.trajs[t].state == "queued" for t in back)
            running -= set(back)
            for t in back:
                where.pop(t)
            continue
        for tid in sorted(running):
            tv = s.trajs[tid]
            assert tv.engine == where[tid], "a running trajectory never moves (sticky)"
            r = rng.random()
            if r < 0.05:
                s.release(tid, "error" if r < 0.025 else "cancel", now)
            elif r < 0.6:
                new = min(known[tid], tv.response_len + 300)
                s.progress(tid, new, tv.turns + 1)
                if new < known[tid]:
                    continue
                s.release(tid, "finished", now)
            else:
                continue
            running.discard(tid)
            released.append(tid)
        if events > 10_000:
            pytest.fail("the schedule never finished")
    return s, released


@pytest.mark.parametrize("policy", SIM_POLICIES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_trajectory_finishes_exactly_once(policy, seed):
    s, released = _drive(policy, seed)
    assert sorted(released) == list(range(30))
    assert all(v.inflight == set() and v.prompts == 0 and not v.load.any() for v in s.engines)


@pytest.mark.parametrize("policy", SIM_POLICIES)
def test_engine_failure_requeues_and_still_exactly_once(policy):
    s, released = _drive(policy, 3, fail_at=2)
    assert sorted(released) == list(range(30))
    dead = [i for i, v in enumerate(s.engines) if not v.alive]
    assert len(dead) == 1
    assert s.summary()["requeued"] > 0
    assert all(t.engine is None for t in s.trajs.values())


def test_second_release_and_unknown_are_errors():
    s = Scheduler([1000], CFG, "kv_aware")
    s.submit(0, "p", 10, 100, 0.0)
    with pytest.raises(SchedulerError):
        s.submit(0, "p", 10, 100, 0.0)
    s.release(0, "cancel", 0.0)  # cancelled while still queued: leaves the queue
    assert s.queued == 0 and s.done
    with pytest.raises(SchedulerError, match="released twice"):
        s.release(0, "finished", 1.0)
    with pytest.raises(SchedulerError, match="never submitted"):
        s.release(7, "finished", 1.0)
    with pytest.raises(ValueError, match="outcome"):
        s.release(0, "lost", 1.0)
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        Scheduler([1000], CFG, "fastest")
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        Scheduler([1000], CFG, "oracle")  # the clairvoyant ones are the simulator's (rstar2.bench.rollout_sim)


def test_error_and_cancel_release_the_reservation():
    """A full engine admits the next trajectory only once a running one ends, whatever the outcome."""
    s = Scheduler([1000], SchedulerCfg(oversubscribe=1.0, prior_frac=1.0, probes_per_prompt=1), "kv_aware")
    for tid in range(3):
        s.submit(tid, f"p{tid}", 100, 800, 0.0)
    assert [t for t, _ in s.dispatch(0.0)] == [0]  # 100 + 800 expected: one fits
    assert s.dispatch(1.0) == []
    s.release(0, "error", 2.0)
    assert [t for t, _ in s.dispatch(2.0)] == [1]
    s.release(1, "cancel", 3.0)
    assert [t for t, _ in s.dispatch(3.0)] == [2]


def test_kv_aware_spreads_siblings_and_learns_lengths():
    s = Scheduler([100_000] * 4, SchedulerCfg(probes_per_prompt=1), "kv_aware")
    for tid in range(16):
        s.submit(tid, "same-prompt", 100, 4000, 0.0)
    engines = [e for _, e in s.dispatch(0.0)]
    assert sorted(engines) == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    for tid in range(16):
        s.progress(tid, 200, 1)
        s.release(tid, "finished", 1.0)
    s.estimator.commit()
    assert s.estimator.samples == 16
    h = s.estimator.grid(4000)
    mean, var = s.estimator.footprint(0, 0, 4000, h)
    # everything seen ended at 200 tokens: a new one holds h tokens while h < 200, then nothing (freed); certain
    assert mean == pytest.approx(np.where(h < 200, h, 0.0)) and not var.any()
    # at 150 tokens after one turn: still running until 200
    assert s.estimator.footprint(150, 1, 4000, h)[0] == pytest.approx(np.where(150 + h < 200, 150 + h, 0.0))


def test_footprint_mean_and_variance_from_survival():
    """Half of the seen trajectories ended at 100 tokens, half at 300: after h tokens a new one holds h tokens
    with probability P(L > h): 1 below 100, 1/2 below 300, then 0; its variance is h^2 p (1 - p)."""
    est = LengthEstimator(min_samples=4)
    for n in (100, 300) * 4:
        est.observe(n, 1)
    est.commit()
    h = np.array([0.0, 50, 150, 250, 350])
    mean, var = est.footprint(0, 0, 1000, h)
    assert mean == pytest.approx([0, 50, 75, 125, 0])
    assert var == pytest.approx([0, 0, 150 ** 2 / 4, 250 ** 2 / 4, 0])
    # one that is still running at 120 tokens is one of the long ones: it holds 120 + h until 300, surely
    mean, var = est.footprint(120, 1, 1000, h)
    assert mean == pytest.approx([120, 170, 270, 0, 0]) and not var.any()


def test_engine_failure_with_no_engine_left_is_an_error():
    s = Scheduler([1000], CFG, "least_requests")
    s.submit(0, "p", 10, 100, 0.0)
    s.dispatch(0.0)
    with pytest.raises(SchedulerError, match="no engine is left"):
        s.engine_failed(0, 1.0)


def test_icc_recovers_the_generating_correlation():
    spec = WorkloadSpec(200, 16, STAGES["s1"], icc=0.4)
    wl = make_workload(spec, np.random.default_rng(0))
    uncapped = wl.response_len < wl.cap
    assert icc(wl.group[uncapped], wl.response_len[uncapped]) == pytest.approx(0.4, abs=0.08)
    with pytest.raises(ValueError):
        icc([0, 0], [1, 2])


@pytest.mark.parametrize("policy", ["static", "round_robin", "least_requests", "kv_aware", "oracle"])
def test_simulator_conserves_work(policy):
    spec = WorkloadSpec(8, 8, STAGES["s1"], icc=0.4)
    wl = make_workload(spec, np.random.default_rng(1))
    r = simulate(wl, Hardware(capacity=60_000), 4, policy, SchedulerCfg(max_inflight=64))
    assert r.decoded == sum(sum(d) for d in wl.decode)  # every decode token once (recompute is prefill)
    assert 0 <= r.idle_frac < 1 and r.makespan_s > 0


def _learned(lengths, turns=1, cfg=None):
    est = LengthEstimator(min_samples=4)
    for n in lengths:
        est.observe(n, turns)
    est.commit()
    return est


def _submit(s, n, budget=4800, prompt=100):
    for tid in range(n):
        s.submit(tid, f"p{tid}", prompt, budget, 0.0)


def test_kv_aware_admits_by_expected_peak_not_by_budget():
    """Every trajectory seen ended at 1,000 tokens. A fresh one then holds h tokens for h < 1,000 (on the grid of
    budget / 48 = 100 tokens: at most 900) plus its prompt (100): ten fit 10,000 tokens at once; reserving the
    budget (4,800 + 100) would admit two."""
    cfg = SchedulerCfg(kv_z=0.0, kv_tail_slack=0.0, probes_per_prompt=1)
    s = Scheduler([10_000], cfg, "kv_aware", _learned([1000] * 32))
    _submit(s, 12)
    assert len(s.dispatch(0.0)) == 10
    assert s.engines[0].peak == pytest.approx(10_000)


def test_measured_usage_beyond_the_footprints_holds_admission():
    """vLLM reports half the KV in use while the footprints (at the last reported lengths) account for the prompts
    only: the difference (4,000 tokens generated since) counts as held, so a release admits nobody until a
    newer report shows room."""
    cfg = SchedulerCfg(kv_z=0.0, kv_tail_slack=0.0, probes_per_prompt=1)
    s = Scheduler([10_000], cfg, "kv_aware", _learned([1000] * 32))
    _submit(s, 12)
    s.dispatch(0.0)
    s.observe_engine(0, 1.0, usage=0.5, preemptions_total=0)
    assert s.engines[0].lag == pytest.approx(4_000)
    s.release(0, "finished", 2.0)
    assert s.dispatch(2.0) == []
    s.observe_engine(0, 3.0, usage=0.0, preemptions_total=0)
    assert [t for t, _ in s.dispatch(3.0)] == [10]


def test_factor_shrinks_on_new_preemptions_not_on_an_engines_earlier_ones():
    """vLLM's preemption counter runs over the engine's life, and engines outlive RL steps: a step's first report
    of 230 (earlier steps' preemptions) is a baseline and leaves the factor at 1; one more preemption after it
    shrinks the factor (x 0.85), and a report with no new one (after adapt_interval_s) does not shrink it again."""
    cfg = SchedulerCfg(kv_z=0.0, kv_tail_slack=0.0, probes_per_prompt=1, adapt_interval_s=1.0)
    s = Scheduler([10_000], cfg, "kv_aware", _learned([1000] * 32))
    _submit(s, 12)
    s.observe_engine(0, 0.0, usage=0.0, preemptions_total=230)
    assert s.engines[0].factor == 1.0
    assert len(s.dispatch(0.0)) == 10
    s.observe_engine(0, 1.0, usage=0.5, preemptions_total=231)
    assert s.engines[0].factor == pytest.approx(0.85)
    s.observe_engine(0, 2.5, usage=0.5, preemptions_total=231)
    assert s.engines[0].factor == pytest.approx(0.85)


def test_lag_compares_vllms_usage_with_the_trajectories_in_a_turn():
    """vLLM's KV usage leaves out a trajectory at a tool (its KV is evictable cache), and a prompt whose rollouts here
    are all at a tool. Trajectories 0, 1 (prompt a) and 2 (prompt b), 100-token prompts, each reported at 300
    tokens; 0 and 1 have generated 50 more since. With 2 at a tool vLLM holds 100 + 2 x 350 = 800 tokens: the lag is
    the 100 generated since the reports (counting 2 and prompt b as held, it would read 0 and admit into their
    cache). Then 1 and 0 leave too (prompt a with them), 1 comes back, and 2 ends while away."""
    cfg = SchedulerCfg(kv_z=0.0, kv_tail_slack=0.0, probes_per_prompt=1)
    s = Scheduler([10_000], cfg, "kv_aware", _learned([1000] * 32))
    for tid, group in enumerate("aab"):
        s.submit(tid, group, 100, 4800, 0.0)
    assert len(s.dispatch(0.0)) == 3
    for tid in range(3):
        s.progress(tid, 300, 1)
    v = s.engines[0]
    s.at_tool(2, True)
    s.observe_engine(0, 1.0, usage=800 / 10_000, preemptions_total=0)
    assert v.away == pytest.approx(400) and v.lag == pytest.approx(100)
    s.at_tool(1, True)
    s.observe_engine(0, 1.1, usage=450 / 10_000, preemptions_total=0)
    assert v.lag == pytest.approx(50)
    s.at_tool(0, True)  # prompt a's rollouts are all away: vLLM holds nothing
    s.observe_engine(0, 1.2, usage=0.0, preemptions_total=0)
    assert v.away == pytest.approx(1100) and v.lag == 0.0
    s.at_tool(1, False)
    assert v.away == pytest.approx(700)
    s.release(2, "finished", 2.0)  # ends at its tool call: its KV and prompt b leave the books
    assert v.away == pytest.approx(300) and v.away_groups == set()


def test_the_rest_of_the_queue_goes_at_once_when_it_fits_within_the_slack():
    """Eleven queued, ten fit the budget on the mean: with 10 % slack the eleventh (11 x 1,000 = 11,000) is not left
    waiting; with 5 % it is."""
    for slack, admitted in ((0.10, 11), (0.05, 10)):
        cfg = SchedulerCfg(kv_z=0.0, kv_tail_slack=slack, probes_per_prompt=1)
        s = Scheduler([10_000], cfg, "kv_aware", _learned([1000] * 32))
        _submit(s, 11)
        assert len(s.dispatch(0.0)) == admitted


def test_z_keeps_room_for_random_lengths():
    """Half end at 100 tokens, half at 900 (grid step 100): after h in [100, 900) a fresh one holds h with
    probability 1/2, so the mean peak is 400 (h = 800) and its sd 400; with z = 2 each costs more than with z = 0,
    and fewer are admitted."""
    est = _learned([100, 900] * 16)
    admitted = {}
    for z in (0.0, 2.0):
        s = Scheduler([10_000], SchedulerCfg(kv_z=z, kv_tail_slack=0.0, probes_per_prompt=1), "kv_aware", est)
        _submit(s, 40, prompt=0)
        admitted[z] = len(s.dispatch(0.0))
    assert admitted[0.0] == 25  # 25 x 400 = 10,000
    # z = 2: n x 400 + 2 x sqrt(n) x 400 <= 10,000  ->  n + 2 sqrt(n) <= 25  ->  n <= 16.8
    assert admitted[2.0] == 16


def test_block_granular_footprints():
    """vLLM allocates KV in blocks (128 tokens on CPU): a 60-token prompt + a 40-token response holds one whole block,
    so with 1,280 tokens of KV ten fit; counted in tokens (60 + at most 30 on the grid), all fourteen would."""
    est = _learned([40] * 32)
    cfg = SchedulerCfg(kv_z=0.0, probes_per_prompt=1)
    for block, admitted in ((1, 14), (128, 10)):
        s = Scheduler([1_280], cfg, "kv_aware", est, block_size=block)
        _submit(s, 14, budget=480, prompt=60)  # grid step 10: a fresh one holds at most 60 + 30 tokens unrounded
        assert len(s.dispatch(0.0)) == admitted


def test_siblings_share_the_prompts_whole_blocks_and_go_where_they_save_kv():
    """Blocks of 32: a 100-token prompt is 96 tokens of whole blocks, shared by its rollouts on one engine (charged
    once there), and a 4-token partial block each rollout holds itself. With KV otherwise even, a sibling goes
    where its prompt already is (96 tokens more room); the shared blocks are freed with the last rollout of the
    prompt on that engine, and only then."""
    cfg = SchedulerCfg(kv_z=0.0, probes_per_prompt=1)
    s = Scheduler([10_000, 10_000], cfg, "kv_aware", _learned([40] * 32), block_size=32)
    for tid, group in enumerate(["a", "b", "a"]):
        s.submit(tid, group, 100, 480, 0.0)
    assert dict(s.dispatch(0.0)) == {0: 0, 1: 1, 2: 0}
    assert [v.prompts for v in s.engines] == [96, 96]
    s.release(0, "finished", 1.0)
    assert s.engines[0].prompts == 96  # rollout 2 still reads the prompt's blocks
    one = Scheduler([10_000], cfg, "kv_aware", _learned([40] * 32), block_size=32)
    for tid, group in enumerate(["a", "b", "a"]):
        one.submit(tid, group, 100, 480, 0.0)
    one.dispatch(0.0)
    one.release(0, "finished", 1.0)
    one.release(2, "finished", 1.0)
    assert one.engines[0].prompts == 96  # a's blocks freed, b's kept


def test_kv_aware_priority_is_start_order_and_survives_a_requeue():
    """Every turn of a kv_aware trajectory carries its start order as vLLM priority (0 = started first); other
    policies (and kv_priority off) leave vLLM first come, first served (all 0)."""
    s = Scheduler([100_000, 100_000], SchedulerCfg(probes_per_prompt=1), "kv_aware")
    _submit(s, 4)
    order = [t for t, _ in s.dispatch(0.0)]
    assert s.uses_priority and [s.priority(t) for t in order] == [0, 1, 2, 3]
    e = s.trajs[order[1]].engine
    back = s.engine_failed(e, 1.0)
    assert order[1] in back
    s.dispatch(1.0)
    assert s.trajs[order[1]].engine != e and s.priority(order[1]) == 1  # resumed elsewhere, same priority
    for policy, cfg in (("round_robin", SchedulerCfg()), ("kv_aware", SchedulerCfg(kv_priority=False))):
        s = Scheduler([100_000], cfg, policy)
        _submit(s, 3)
        s.dispatch(0.0)
        assert not s.uses_priority and [s.priority(t) for t in range(3)] == [0, 0, 0]


def test_simulated_vllm_preempts_by_priority_or_newest():
    """The simulated engine's overflow victim: FCFS preempts the sequence admitted last (vLLM V1's default),
    priority scheduling the largest (priority, admission order), which goes back to the waiting queue in priority
    order, not to its front."""
    from rstar2.bench.rollout_sim import SimEngine, _Req

    def overflowing(by_priority: bool) -> SimEngine:
        en = SimEngine(Hardware(capacity=400), by_priority)
        for tid, prio in ((0, 2), (1, 0), (2, 1)):  # admitted in this order (tid 2 the newest): 3 x 100 prompt
            en.submit(_Req(tid, tid, 100, 100, 0, 500, prio))
        en.admit()
        en.advance(en.steps_to_next_event())  # the prefill step
        en.advance(en.steps_to_next_event())  # then until KV runs out: 399 of 400 tokens
        assert en.kv == 399
        en.submit(_Req(3, 3, 100, 100, 0, 10, 5))  # no room for it, nor for the next step: one must go
        en.admit()
        return en

    fcfs = overflowing(False)
    assert set(fcfs.running) == {0, 1} and fcfs.preemptions == 1 and fcfs.waiting[0].tid == 2
    prio = overflowing(True)
    assert set(prio.running) == {1, 2} and prio.preemptions == 1
    assert [r.tid for r in prio.waiting] == [0, 3]  # priority 2 before the waiting priority 5


def test_simulated_vllm_reports_usage_as_vllm_does():
    """The simulated engine tells the scheduler what vLLM's stats would: a sequence waiting on a tool keeps its KV
    only as evictable prefix cache, which vLLM's block pool counts as free, so usage drops when its turn ends; its
    cache still takes room (an admission must evict it first)."""
    from rstar2.bench.rollout_sim import SimEngine, _Req

    en = SimEngine(Hardware(capacity=1000))
    en.submit(_Req(0, 0, 100, 100, 0, 50))
    en.admit()
    en.advance(en.steps_to_next_event())  # the prefill step
    [tid] = en.advance(en.steps_to_next_event())  # its turn ends after 50 tokens
    assert en.usage == pytest.approx(0.15)  # prompt + 50
    en.finish_turn(tid, keep_cache=True)  # off to a tool
    assert en.usage == 0.0 and en.cached_kv == 50
    en.submit(_Req(1, 1, 960, 960, 0, 10))  # needs the cached 50 tokens' room: evicts them
    en.admit()
    assert en.evictions == 1 and en.cached_kv == 0 and en.preemptions == 0


def test_session_orders_the_protocol_by_hand():
    """Two engines, one trajectory each at a time (least_requests, max_inflight 1), three trajectories:
    0 leaves for a tool and keeps engine 0 (sticky), 1 ends and engine 1 takes 2, whose broken call gets a reply at
    once (its next turn goes in now); engine 0 dies while 0 is at its tool, 0's reply comes in while it waits in
    the queue, and once 2 ends 0 resumes on engine 1 with its reply in: sent at once."""
    s = SchedulerSession(Scheduler([1000, 1000], SchedulerCfg(max_inflight=1), "least_requests"))
    for tid in range(3):
        s.submit(tid, f"p{tid}", 10, 100, 0.0)
    assert s.placements(0.0) == [(0, 0), (1, 1)]
    assert not s.turn_done(0, 0, 1.0, 20, 1, TOOL, (0.1, 0))
    assert s.placements(1.0) == [] and s.engine_of(0) == 0
    assert not s.turn_done(1, 1, 2.0, 30, 1, END, (0.0, 0))
    assert s.placements(2.0) == [(2, 1)]
    assert s.turn_done(2, 1, 3.0, 25, 1, TURN, (0.1, 0))  # a reply known without running code: next turn now
    assert s.engine_failed(0, 4.0) == [0]
    assert s.placements(4.0) == [] and s.engine_of(0) is None  # engine 1 is full
    assert not s.tool_done(0, 5.0, 40, 1, ended=False)  # queued: its turn goes in when it is placed
    assert not s.turn_done(2, 1, 6.0, 50, 2, END, (0.0, 0))
    assert s.placements(6.0) == [(0, 1)]
    assert s.sched.trajs[0].response_len == 40  # its reply counted
    assert not s.turn_done(0, 1, 7.0, 60, 2, END)
    assert s.done and s.finish()["requeued"] == 1
    assert s.sched.estimator.samples == 3  # every finished trajectory's length joins the estimate at finish()


def test_session_a_trajectory_requeued_at_its_tool_is_placed_but_sent_only_with_its_reply():
    """Engine 0 dies while 0 is at its tool; engine 1 is free: 0 is placed there at once, away (its KV is the
    tool-waiting kind), and its turn goes in when the reply does. A reply that does not fit ends it."""
    s = SchedulerSession(Scheduler([1000, 1000], SchedulerCfg(kv_z=0.0, probes_per_prompt=1), "kv_aware"))
    for tid in range(2):
        s.submit(tid, "p", 10, 100, 0.0)
    placed = dict(s.placements(0.0))
    assert set(placed) == {0, 1}
    zero_on, one_on = placed[0], placed[1]
    assert not s.turn_done(0, zero_on, 1.0, 20, 1, TOOL, (0.05, 0))
    assert not s.turn_done(1, one_on, 1.0, 20, 1, TOOL, (0.0, 0))
    s.engine_failed(zero_on, 2.0)
    assert s.placements(2.0) == []  # placed, not sent: away
    assert s.engine_of(0) is not None and s.sched.trajs[0].away_kv is not None
    assert s.tool_done(0, 3.0, 30, 1, ended=False)  # now its turn goes in, to engine_of(0)
    assert s.sched.trajs[0].away_kv is None
    assert not s.tool_done(1, 3.0, 20, 1, ended=True)  # 1's reply did not fit: it ended
    assert not s.turn_done(0, s.engine_of(0), 4.0, 50, 2, END, (0.0, 0))
    assert s.done
