"""The engine's continuous-batching loop (rstar2.rollout.engine_loop.EngineLoop) around a toy backend: requests
finish independently, a reload pauses admission and drains what is in flight, nothing is lost, a broken step fails
everything clearly. The same loop around real vLLM runs in tests/engine/test_engine_actor.py."""

import threading
import time

import pytest

from rstar2.rollout.engine_loop import EngineLoop


class Toy:
    """One token per request per step; the token is the weights version, so a test sees which weights made it."""

    def __init__(self, step_s=0.002, fail_at_step=None):
        self.step_s, self.fail_at_step = step_s, fail_at_step
        self.version, self.reqs, self.steps, self.priorities = 0, {}, 0, {}
        self.inflight_at_reload: list[int] = []
        self.thread: set[str] = set()

    def add(self, rid, prompt, max_tokens, temperature, top_p, seed=None, priority=0, logprobs=False):
        self.thread.add(threading.current_thread().name)
        self.priorities[rid] = priority
        self.reqs[rid] = ([], max_tokens, logprobs)

    def step(self):
        self.thread.add(threading.current_thread().name)
        self.steps += 1
        if self.steps == self.fail_at_step:
            raise RuntimeError("device lost")
        time.sleep(self.step_s)
        out = []
        for rid, (ids, m, logprobs) in list(self.reqs.items()):
            ids.append(self.version)
            if len(ids) >= m:  # a token's "log-prob" here: minus its position, so a test sees the alignment
                out.append((rid, ids, "length", [-float(i) for i in range(len(ids))] if logprobs else None))
                del self.reqs[rid]
        return out

    def reload(self, model_dir):
        self.inflight_at_reload.append(len(self.reqs))
        self.version = int(model_dir)

    def reset_cache(self):
        self.inflight_at_reload.append(len(self.reqs))

    def stats(self):
        return {"kv_usage": len(self.reqs) / 100, "preemptions": 0}


@pytest.fixture
def loop():
    toy = Toy()
    lp = EngineLoop(toy, name="toy-loop")
    yield lp, toy
    lp.close()


def test_requests_finish_independently(loop):
    lp, toy = loop
    long = lp.submit([1], 200)
    time.sleep(0.02)  # the long one is generating
    short = [lp.submit([2], 3) for _ in range(4)]
    assert [f.result(timeout=5)[:2] for f in short] == [([0, 0, 0], "length")] * 4
    assert not long.done()  # the short ones did not wait for it
    ids, finish, stats, logprobs = long.result(timeout=5)
    assert len(ids) == 200 and finish == "length" and set(stats) >= {"kv_usage", "preemptions"} and logprobs is None
    assert toy.thread == {"toy-loop"}  # only the loop thread touches the backend
    s = lp.stats()
    assert s["generated"] == 212 and s["steps"] >= 200 and s["in_flight"] == 0


def test_log_probs_come_back_only_for_the_requests_that_ask(loop):
    lp, _ = loop
    asked, plain = lp.submit_many([[1], [2]], [3, 2], logprobs=True), lp.submit([3], 2)
    assert [f.result(timeout=5)[3] for f in asked] == [[0.0, -1.0, -2.0], [0.0, -1.0]]
    assert plain.result(timeout=5)[3] is None


def test_reload_drains_in_flight_and_holds_new_requests(loop):
    lp, toy = loop
    before = [lp.submit([1], 30) for _ in range(3)]
    time.sleep(0.01)
    reload = lp.reload("1")
    after = [lp.submit([2], 5) for _ in range(3)]  # arrive while the reload waits: held, not lost
    assert reload.result(timeout=5) >= 0
    assert toy.inflight_at_reload == [0]  # the reload ran on a drained engine
    assert all(f.done() and f.result()[0] == [0] * 30 for f in before)  # in flight: finished on the old weights
    assert [f.result(timeout=5)[0] for f in after] == [[1] * 5] * 3  # held: admitted after, on the new weights


def test_cache_reset_waits_for_a_drained_engine(loop):
    lp, toy = loop
    before = [lp.submit([1], 20) for _ in range(2)]
    time.sleep(0.01)
    reset = lp.reset_cache()
    after = lp.submit([2], 3)
    assert reset.result(timeout=5) >= 0
    assert toy.inflight_at_reload == [0] and all(f.done() for f in before)  # vLLM refuses a reset while blocks are used
    assert after.result(timeout=5)[0] == [0] * 3  # held meanwhile, then admitted


def test_concurrent_submitters_lose_nothing(loop):
    lp, _ = loop
    futs, lock = [], threading.Lock()

    def client(k):
        for i in range(25):
            f = lp.submit([k], 1 + (i * 7 + k) % 9)
            with lock:
                futs.append((f, 1 + (i * 7 + k) % 9))

    threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    reload = lp.reload("2")
    for t in threads:
        t.join()
    reload.result(timeout=10)
    assert len(futs) == 200 and all(len(f.result(timeout=10)[0]) == m for f, m in futs)


def test_a_broken_step_fails_every_request_clearly():
    toy = Toy(fail_at_step=3)
    lp = EngineLoop(toy)
    futs = [lp.submit([1], 10) for _ in range(3)]
    for f in futs:
        with pytest.raises(RuntimeError, match="device lost"):
            f.result(timeout=5)
    with pytest.raises(RuntimeError, match="engine is down"):
        lp.submit([1], 1).result(timeout=5)
    assert "device lost" in lp.stats()["error"]


def test_a_failed_reload_fails_itself_and_the_engine_serves_on(loop):
    """A weight load cut off (a collective sync whose peer went away) fails its own future; the loop lives on, so the
    caller's next load and later requests are served (before, the loop thread died and they waited forever)."""
    lp, toy = loop

    def reload(weights):
        if weights == "cut":
            raise ConnectionError("peer closed")

    toy.reload = reload
    with pytest.raises(ConnectionError, match="peer closed"):
        lp.reload("cut").result(timeout=5)
    assert lp.reload("whole").result(timeout=5) >= 0
    assert len(lp.submit([1], 3).result(timeout=5)[0]) == 3 and lp.stats()["error"] is None


def test_work_sent_to_a_broken_engine_fails_at_once():
    lp = EngineLoop(Toy(fail_at_step=1))
    with pytest.raises(RuntimeError, match="device lost"):
        lp.submit([1], 10).result(timeout=5)
    with pytest.raises(RuntimeError, match="engine is down"):
        lp.reload("any").result(timeout=5)  # not queued behind a loop thread that is gone


def test_a_stuck_step_still_answers_probes_with_frozen_progress():
    """What the agent loop's hang detection relies on: while the engine thread is stuck in a step, stats() answers
    at once, and its step counter stands still."""
    gate = threading.Event()
    toy = Toy()
    step = toy.step
    toy.step = lambda: (gate.wait() if toy.steps >= 5 else None, step())[1]
    lp = EngineLoop(toy)
    f = lp.submit([1], 50)
    time.sleep(0.1)
    first = lp.stats()
    time.sleep(0.1)
    assert lp.stats()["steps"] == first["steps"] <= 6 and first["in_flight"] == 1 and not f.done()
    gate.set()
    assert len(f.result(timeout=5)[0]) == 50
    lp.close()


def test_chains_send_each_turn_when_the_one_before_finishes():
    """A replay: every chain's first turn is admitted together; turn k+1 is admitted by the loop thread the step
    after turn k finished (no caller in between), with the context and budget it was given."""
    class Logged(Toy):
        def __init__(self):
            super().__init__(step_s=0.0)
            self.added: list[tuple[int, int, list]] = []  # (step, max_tokens, prompt)

        def add(self, rid, prompt, max_tokens, temperature, top_p, seed=None, priority=0, logprobs=False):
            self.added.append((self.steps, max_tokens, prompt))
            super().add(rid, prompt, max_tokens, temperature, top_p, seed, priority, logprobs)

    toy = Logged()
    lp = EngineLoop(toy, name="toy-loop")
    chains = [[([1], 3, None), ([1, 9], 2, None)], [([2], 1, 5)],
              [([3], 2, None), ([3, 9], 4, None), ([3, 9, 9], 1, None)]]
    outs = [f.result(timeout=5) for f in lp.submit_chains(chains)]
    lp.close()
    assert outs == [[([0] * 3, "length"), ([0] * 2, "length")], [([0], "length")],
                    [([0] * 2, "length"), ([0] * 4, "length"), ([0], "length")]]
    assert {p[0] for s, _, p in toy.added if s == 0} == {1, 2, 3}  # the first turns together, before any step
    at = {tuple(p): (s, m) for s, m, p in toy.added}
    assert at[(1, 9)] == (3, 2) and at[(3, 9)] == (2, 4) and at[(3, 9, 9)] == (6, 1)  # the step its turn before ended


def test_a_broken_engine_fails_its_chains():
    lp = EngineLoop(Toy(step_s=0.0, fail_at_step=3), name="toy-loop")
    futs = lp.submit_chains([[([1], 2, None), ([1, 9], 5, None)]])
    with pytest.raises(RuntimeError, match="device lost"):
        futs[0].result(timeout=5)
    lp.close()


def test_priorities_reach_the_backend(loop):
    """Each request's priority (vLLM's: lower runs first, preempted last) goes to the backend with it; 0 unless
    given."""
    lp, toy = loop
    futs = lp.submit_many([[1], [2], [3]], [2, 2, 2], priorities=[5, 0, 2]) + [lp.submit([4], 2)]
    for f in futs:
        f.result(timeout=5)
    assert sorted(toy.priorities.values()) == [0, 0, 2, 5] and len(toy.priorities) == 4


def test_abort_drops_the_requests_and_frees_the_engine(loop):
    """A partial rollout's cut: the aborted turns fail with Aborted, the backend drops them, the others go on."""
    from rstar2.rollout.engine_loop import Aborted

    lp, toy = loop
    aborted = []
    toy.abort = lambda rids: (aborted.extend(rids), [toy.reqs.pop(r) for r in rids])
    long, other = lp.submit([1], 10_000), lp.submit([2], 10_000)
    short = lp.submit([3], 3)
    time.sleep(0.02)
    lp.abort([long, short])  # short may be done already: left as it is
    with pytest.raises(Aborted):
        long.result(timeout=5)
    assert short.result(timeout=5)[0] == [0, 0, 0]
    assert len(aborted) == 1 and not other.done()
    lp.abort([other])
    with pytest.raises(Aborted):
        other.result(timeout=5)
    assert not toy.reqs and lp.stats()["in_flight"] == 0
