"""The agent loop's tool calls go to the sandbox as futures (rstar2.rollout.agent_loop): the calls in flight are
bounded by the sandbox alone, not by a pool in the loop, and each result lands on the turn that called it."""

import threading
from concurrent.futures import Future

from rstar2.sandbox import ExecResult
from tests.unit import test_rollout
from tests.unit.test_rollout import ANSWER, TINY, FakeEngine, run_sched, scripted

chat = test_rollout.chat  # the rollout tests' byte-level chat fixture, shared

PROBLEMS, SAMPLES = 12, 4  # 48 trajectories, each calling the tool once


class HoldingSandbox:
    """A sandbox that answers no call until `hold` calls are in flight together (or `patience_s` passed since the
    first), then answers all it holds and every later one at once; `peak`: the most calls in flight at one time. A
    loop that caps its calls below `hold` shows as a peak below it. `answers`: stdout by code."""

    def __init__(self, answers: dict[str, str], hold: int, patience_s: float = 10.0):
        self.answers, self.hold, self.patience_s = answers, hold, patience_s
        self.lock = threading.Lock()
        self.held: list = []
        self.out = self.peak = 0
        self.released = False
        self.timer: threading.Timer | None = None

    def submit(self, req) -> Future:
        fut: Future = Future()
        fut.add_done_callback(self._back)
        with self.lock:
            self.out += 1
            self.peak = max(self.peak, self.out)
            self.held.append((req, fut))
            if self.timer is None:
                self.timer = threading.Timer(self.patience_s, self._release)
                self.timer.start()
            release = self.released or len(self.held) >= self.hold
        if release:
            self._release()
        return fut

    def _back(self, _fut: Future) -> None:
        with self.lock:
            self.out -= 1

    def _release(self) -> None:
        with self.lock:
            self.released, held, self.held = True, self.held, []
        for req, fut in held:
            fut.set_result(ExecResult("ok", self.answers[req.code], "", 0, 0.0, 0.0))


def test_a_tool_heavy_rollout_is_not_capped_at_32_calls_and_gets_the_same_trajectories(chat, service):
    """48 trajectories on two engines each call the tool once, with its own code (problem k prints k * 7): all 48
    calls are in the sandbox at once (the loop's former 32-thread pool held the 33rd back), and the trajectories
    equal those of the real sandbox service (2 workers, so at most 2 calls run there at a time) token for token."""
    script = {f"zp{k:02d}": [TINY.assistant_turn("\nuse python\n</reason>\n", f"print({k} * 7)"), ANSWER]
              for k in range(PROBLEMS)}
    answers = {f"print({k} * 7)": f"{k * 7}\n" for k in range(PROBLEMS)}
    gen = scripted(chat, script)
    held = HoldingSandbox(answers, hold=PROBLEMS * SAMPLES)
    try:
        trajs, stats = run_sched(chat, held, script, [FakeEngine(gen), FakeEngine(gen)], samples=SAMPLES,
                                 policy="least_requests", seed=5, max_turns=5, max_response_tokens=2000)
    finally:
        held.timer.cancel()
    assert held.peak == PROBLEMS * SAMPLES == 48 > 32
    ref, _ = run_sched(chat, service, script, [FakeEngine(gen)], samples=SAMPLES, policy="least_requests", seed=5,
                       max_turns=5, max_response_tokens=2000)
    key = lambda ts: {(t.problem_id, t.sample_idx): (t.response_ids, t.loss_mask, t.tool_replies)  # noqa: E731
                      for t in ts}
    assert key(trajs) == key(ref) and len(trajs) == 48
    for t in trajs:  # problem k's reply is k * 7, on its first (its calling) turn
        k = int(t.problem_id[2:])
        assert t.tool_statuses == ["ok"] and t.tool_replies == [f"Tool call success\nstdout: {k * 7}\n"]
        assert t.num_turns == 2 and t.done and not t.truncated
    assert stats["sched_tool_wait_s"] > 0
