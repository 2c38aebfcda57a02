"""A partial rollout (rstar2.rollout.partial): the cut worked by hand, a trajectory cut back to T*, the carry on disk,
the prompt stream; then through the agent loop, where the partial rollout must equal the whole rollout cut at T*,
whatever the timing, and its carry must go on in the next step."""

import pytest

from rstar2.core.config import SchedulerCfg
from rstar2.rollout import partial, trajectory
from rstar2.rollout.agent_loop import AgentLoop, EngineSet
from rstar2.rollout.partial import Carry, Cut, cut_back
from rstar2.rollout.trajectory import Trajectory
from rstar2.run import steps
from tests.unit import test_rollout
from tests.unit.test_rollout import ANSWER, CALL, FakeEngine, scripted

chat = test_rollout.chat  # the rollout tests' byte-level chat fixture, shared


def feed(cut, events):
    """events: (tid, clock) after a model turn, or (tid, None): it ended."""
    for tid, clock in events:
        cut.ended(tid) if clock is None else cut.progress(tid, clock)


def test_the_cut_takes_the_quota_of_groups_that_complete_first_on_the_clock():
    cut = Cut([[0, 1], [2, 3], [4, 5]], carried=0, quota=2)
    feed(cut, [(0, 10), (0, None), (2, 20), (2, None), (1, 30), (3, 25), (3, None)])
    assert cut.bound == (float("inf"), float("inf")) and not cut.holds(1)  # one group complete: T* unknown
    feed(cut, [(1, None)])  # group 0 complete at 30, group 1 at 25: T* = 30 (group 0)
    assert cut.bound == (30, 0) and not cut.settled  # 4 and 5 have not passed 30: their state at T* is unknown
    feed(cut, [(4, 12), (5, 5), (4, 40)])
    assert cut.holds(4) and not cut.holds(5) and not cut.settled
    feed(cut, [(5, 31)])
    assert cut.settled and cut.taken() == [1, 0] and cut.t_star == 30


def test_ties_go_to_the_earlier_group_and_a_later_complete_group_lowers_the_cut():
    cut = Cut([[0], [1], [2]], carried=0, quota=1)
    feed(cut, [(1, 50), (1, None)])
    assert cut.bound == (50, 1)
    feed(cut, [(0, 50), (0, None)])  # the same clock, an earlier group
    assert cut.bound == (50, 0) and not cut.settled
    feed(cut, [(2, 50)])  # (50, 2) > (50, 0): past the cut
    assert cut.settled and cut.taken() == [0]


def test_carried_groups_must_complete_and_count_against_the_quota():
    cut = Cut([[0], [1], [2]], carried=1, quota=2)  # one carried, one new to take
    feed(cut, [(1, 5), (1, None), (2, 9)])
    assert cut.bound == (5, 1) and not cut.settled  # the carried group is still running
    assert not cut.holds(0)  # never held, however far it goes
    feed(cut, [(0, 100), (0, None)])
    assert cut.settled and cut.taken() == [0, 1]
    with pytest.raises(ValueError, match="fewer than its quota"):
        Cut([[0], [1]], carried=2, quota=2)


def test_extra_groups_stay_below_the_quota():
    assert [partial.extra_groups(q, 0.25) for q in (1, 2, 4, 16, 64)] == [0, 1, 1, 4, 16]
    assert partial.extra_groups(4, 1.0) == 3


def traj(mask, statuses, turn_starts, done=True, step_turns=0):
    """A trajectory whose response is `mask` (1 model, 0 tool tokens; the token ids are the positions)."""
    t = Trajectory("p", 0, "42", [7, 7], 100, response_ids=list(range(len(mask))), loss_mask=list(mask),
                   tool_statuses=list(statuses), tool_wall_s=[0.1] * len(statuses),
                   tool_replies=["r"] * len(statuses), assistant_turns=[f"turn {k}" for k in range(len(turn_starts))],
                   done=done, response_logprobs=[-1.0] * len(mask), turn_starts=list(turn_starts),
                   turn_versions=[3] * len(turn_starts), step_turns=step_turns)
    return t


def test_a_trajectory_is_cut_back_to_its_turns_that_ended_by_the_cut():
    # turn 0: 5 model tokens then a 3-token tool reply; turn 1: 4 model tokens (the end). Clocks: 5, then 9.
    mask, starts = [1] * 5 + [0] * 3 + [1] * 4, [0, 8]
    t = traj(mask, ["ok"], starts)
    assert cut_back(t, 9) == 0 and t.done  # ended by the cut: kept whole
    t = traj(mask, ["ok"], starts)
    assert cut_back(t, 6) == 4
    assert (t.response_ids, t.assistant_turns, t.tool_statuses, t.turn_starts) == \
        (list(range(8)), ["turn 0"], ["ok"], [0])
    assert len(t.loss_mask) == len(t.response_logprobs) == 8 and not t.done and not t.truncated
    t = traj(mask, ["ok"], starts)
    assert cut_back(t, 4) == 9 and t.response_ids == [] and t.num_turns == 0
    t = traj(mask, ["ok"], starts, step_turns=1)  # carried with turn 0 done: only turn 1 is this step's (clock 4)
    assert cut_back(t, 3) == 4 and t.num_turns == 1 and len(t.response_ids) == 8


def test_the_carry_round_trips_with_its_cursor(tmp_path):
    t = traj([1] * 5 + [0] * 3, ["ok"], [0], done=False)
    uri = str(tmp_path / "carry.parquet")
    steps.write_carry(uri, Carry([t], {"p": "question p"}, cursor=37))
    back = steps.read_carry(uri)
    assert back.cursor == 37 and back.prompts == {"p": "question p"} and back.problem_ids == {"p"}
    (b,) = back.trajs
    for k in partial.CARRIED:
        assert getattr(b, k) == getattr(t, k), k
    assert b.step_turns == 1  # its turn is not the next step's
    steps.write_carry(uri, Carry([], {}, cursor=5))  # nothing carried: the cursor still goes on
    assert steps.read_carry(uri).cursor == 5 and steps.read_carry(uri).trajs == []
    assert steps.read_carry(None).cursor == 0
    with pytest.raises(FileNotFoundError, match="left no carry"):
        steps.read_carry(str(tmp_path / "none.parquet"))


@pytest.fixture
def problems_uri(tmp_path):
    import polars as pl
    uri = tmp_path / "train.parquet"
    pl.DataFrame({"problem_id": [f"q{i}" for i in range(6)], "prompt": [f"question {i}" for i in range(6)],
                  "answer": ["1"] * 6}).write_parquet(uri)
    return str(uri)


def test_the_prompt_stream_passes_over_problems_in_flight(problems_uri):
    order = [p["problem_id"] for p in steps.draw_prompts(problems_uri, 0, 6, seed=3)[0]]
    assert sorted(order) == [f"q{i}" for i in range(6)]  # one epoch: each once
    assert [p["problem_id"] for p in steps.select_prompts(problems_uri, 1, 2, 3)] == order[2:4]  # as before
    got, cursor = steps.draw_prompts(problems_uri, 0, 3, 3, skip={order[1]})
    assert [p["problem_id"] for p in got] == [order[0], order[2], order[3]] and cursor == 4
    got, cursor = steps.draw_prompts(problems_uri, 4, 3, 3)  # the next epoch, same permutation
    assert [p["problem_id"] for p in got] == [order[4], order[5], order[0]] and cursor == 7
    with pytest.raises(ValueError, match="too few"):
        steps.draw_prompts(problems_uri, 0, 5, 3, skip={"q0", "q1"})


# ---- through the agent loop -----------------------------------------------------------------------------------
SCRIPT = {"zqa": [ANSWER], "zqb": [CALL, ANSWER], "zqc": [CALL, CALL, CALL, ANSWER], "zqd": [CALL, CALL, ANSWER],
          "zqe": [ANSWER]}


def roll(chat, service, engines, quota=None, carried=(), policy="kv_aware", version=0, problems=SCRIPT):
    probs = [{"problem_id": k, "prompt": f"question {k}", "answer": "42"} for k in problems]
    loop = AgentLoop(EngineSet(engines, [10_000] * len(engines)), SchedulerCfg(), service, chat,
                     trajectory.RolloutLimits(max_turns=6, max_response_tokens=4000), policy)
    trajs, _ = loop.run(probs, 2, seed=11, version=version, carried=list(carried), quota=quota)
    return trajs, loop.cut


def state(t):
    return (t.problem_id, t.sample_idx, t.response_ids, t.loss_mask, t.tool_statuses, t.turn_versions, t.done)


def test_a_partial_rollout_is_the_whole_rollout_cut_at_t_star_whatever_the_timing(chat, service):
    gen = scripted(chat, SCRIPT)
    whole, _ = roll(chat, service, [FakeEngine(gen)])
    # the reference, worked from the whole rollout: each group completes at its longest trajectory's model tokens
    model = lambda t: sum(t.loss_mask)  # noqa: E731
    order = sorted((max(model(t) for t in whole[2 * g:2 * g + 2]), g) for g in range(len(SCRIPT)))
    t_star, want = order[2][0], sorted(g for _, g in order[:3])
    assert order[2][0] < order[3][0]  # the script's groups differ: the cut leaves two groups out
    jitter = lambda p: 0.002 * (sum(p) % 5)  # noqa: E731
    for policy, engines in [("kv_aware", [FakeEngine(gen)]),
                            ("round_robin", [FakeEngine(gen, jitter), FakeEngine(gen)])]:
        trajs, cut = roll(chat, service, engines, quota=3, policy=policy)
        whole, dropped = roll(chat, service, [FakeEngine(gen)])[0], []
        assert cut.settled and sorted(cut.taken()) == want and cut.t_star == t_star
        assert all(e.cancels == 1 for e in engines)  # the turns still out were aborted
        for g, tids in enumerate(cut.groups):
            for tid in tids:
                t, ref = trajs[tid], whole[tid]
                if g in want:
                    assert state(t) == state(ref)
                else:
                    cut_back(t, t_star)
                    dropped.append(cut_back(ref, t_star))
                    assert state(t) == state(ref) and sum(t.loss_mask) <= t_star
        assert sum(dropped) > 0  # the whole rollout went past T*: the partial one stopped short of it


def test_the_carry_goes_on_in_the_next_rollout_and_is_taken_there(chat, service):
    gen = scripted(chat, SCRIPT)
    first, cut = roll(chat, service, [FakeEngine(gen)], quota=3)
    taken = set(cut.taken())
    left = [first[i] for g, tids in enumerate(cut.groups) if g not in taken for i in tids]
    for t in left:
        cut_back(t, cut.t_star)
    carry = steps.partial.from_carry_rows(steps.partial.carry_rows(left, {t.problem_id: "" for t in left}))[0]
    assert carry and any(t.step_turns for t in carry)  # some carried with turns already made
    more = {"zqf": [ANSWER], "zqg": [CALL, ANSWER]}
    gen2 = scripted(chat, {**SCRIPT, **more})
    second, cut2 = roll(chat, service, [FakeEngine(gen2)], quota=3, carried=carry, version=1, problems=more)
    n_carried = len({t.problem_id for t in carry})
    assert cut2.taken()[:n_carried] == list(range(n_carried))  # every carried group is taken
    whole, _ = roll(chat, service, [FakeEngine(gen)])
    ref = {(t.problem_id, t.sample_idx): t for t in whole}
    for t in second[:len(carry)]:  # finished now: its first turns of version 0, the rest of version 1
        r = ref[(t.problem_id, t.sample_idx)]
        assert t.done and t.num_turns == r.num_turns and t.turn_versions[0] == 0
        kept = t.step_turns
        assert t.response_ids[:t.turn_starts[kept] if kept < t.num_turns else None] == \
            r.response_ids[:r.turn_starts[kept] if kept < r.num_turns else None]
        assert set(t.turn_versions[kept:]) <= {1}
