"""The agent loop (rstar2.rollout.agent_loop) and the trajectory's turns (rstar2.rollout.trajectory): a scripted policy
on a continuous-batching stand-in engine replaces vLLM here (the real engine runs in tests/engine and the end-to-end
flow test); the sandbox is the real one."""

import re
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from rstar2.core.config import SchedulerCfg
from rstar2.rollout import stream_check, trajectory
from rstar2.rollout.agent_loop import AgentLoop, EngineSet
from rstar2.rollout.chat import ChatFormat
from rstar2.world.tokenizer import CHAT_TEMPLATE, IM_END, PAD, SPECIAL_TOKENS

TINY = ChatFormat.from_template(CHAT_TEMPLATE, SPECIAL_TOKENS, "the tiny world's template")  # text only


@pytest.fixture(scope="module")
def chat():
    # the tiny world's chat format on a byte-level tokenizer: every byte is a token, special tokens are single ids
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(["x"], trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL_TOKENS,
                                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=t, eos_token=IM_END, pad_token=PAD)
    tok.chat_template = CHAT_TEMPLATE
    return ChatFormat.of(tok, "byte-level tiny")


def scripted(chat, turns_by_problem):
    """generate() that replies with the next scripted turn of each trajectory's problem (a seeded turn starts with
    its seed, as a sampled one would depend on it)."""
    def generate(prompts, max_tokens, seeds=None):
        outs = []
        for p, m, s in zip(prompts, max_tokens, seeds or [None] * len(prompts)):
            text = chat.tokenizer.decode(p, skip_special_tokens=False)
            pid = next(k for k in turns_by_problem if k in text)
            turn = text.count("<|im_start|>assistant") - 1
            ids = chat.encode(("" if s is None else f"<{s}>") + turns_by_problem[pid][turn])
            outs.append((ids[:m], "length" if len(ids) > m else "stop"))
        return outs
    return generate


CALL = TINY.assistant_turn("\nuse python\n</reason>\n", "print(6 * 7)")
ANSWER = TINY.assistant_turn("\ndone\n</reason>\n<answer>\\boxed{42}</answer>")


def run(chat, service, script, **limits):
    """One sample per scripted problem through the agent loop on one stand-in engine, by problem id."""
    trajs, _ = run_sched(chat, service, script, [FakeEngine(scripted(chat, script))], samples=1,
                         policy="least_requests", **limits)
    return {t.problem_id: t for t in trajs}


def test_tool_turn_masks_and_statuses(chat, service):
    broken = '\n</reason>\n<tool_call>\n{"name": oops}\n</tool_call><|im_end|>'
    t = run(chat, service, {"zqa": [CALL, ANSWER], "zqb": [broken, ANSWER], "zqc": [ANSWER]}, max_turns=5,
            max_response_tokens=2000)
    a = t["zqa"]
    assert a.tool_statuses == ["ok"] and a.num_turns == 2 and not a.truncated
    text = chat.tokenizer.decode(a.response_ids, skip_special_tokens=False)
    assert "stdout: 42" in text and text.endswith(ANSWER)
    tool_part = chat.tokenizer.decode([i for i, m in zip(a.response_ids, a.loss_mask) if m == 0],
                                      skip_special_tokens=False)
    model_part = chat.tokenizer.decode([i for i, m in zip(a.response_ids, a.loss_mask) if m == 1],
                                       skip_special_tokens=False)
    assert tool_part == chat.tool_turn("Tool call success\nstdout: 42\n")
    assert model_part == CALL + ANSWER  # every model token has mask 1, every tool token mask 0
    assert t["zqb"].tool_statuses == ["parse_error"] and "Failed to decode tool call" in \
        chat.tokenizer.decode(t["zqb"].response_ids, skip_special_tokens=False)
    assert t["zqc"].tool_statuses == [] and t["zqc"].num_turns == 1
    # what the loop appended, a real sandbox reply and a parse error among it, is what the template writes
    assert stream_check.check(list(t.values()), {k: f"question {k}" for k in t}, chat) == 3


def test_budget_and_turn_limits_truncate_never_ending_on_a_tool_turn(chat, service):
    t = run(chat, service, {"zqa": [CALL, CALL, CALL, ANSWER]}, max_turns=2, max_response_tokens=2000)["zqa"]
    assert t.truncated and t.num_turns == 2 and t.loss_mask[-1] == 1
    short = run(chat, service, {"zqa": [CALL, ANSWER]}, max_turns=5, max_response_tokens=len(CALL.encode()) + 10)["zqa"]
    assert short.truncated and short.loss_mask[-1] == 1  # the tool reply did not fit: stop before it
    cut = run(chat, service, {"zqa": [ANSWER]}, max_turns=5, max_response_tokens=5)["zqa"]
    assert cut.truncated and len(cut.response_ids) == 5


def test_engine_log_probs_are_recorded_aligned_with_the_response(chat, service):
    """Each model token carries the engine's log-prob of it, each tool token 0.0 (loss mask 0); the table has the
    column only when the client asked for log-probs, and a turn that comes back without them is refused."""
    script = {"zqa": [CALL, ANSWER]}
    trajs, _ = run_sched(chat, service, script, [FakeEngine(scripted(chat, script), logprobs=True)], samples=1,
                         policy="least_requests", max_turns=5, max_response_tokens=2000)
    t = trajs[0]
    assert t.num_turns == 2 and 0 in t.loss_mask and len(t.response_logprobs) == len(t.response_ids)
    assert t.response_logprobs == [-1.0 - i % 7 if m else 0.0 for i, m in zip(t.response_ids, t.loss_mask)]
    assert trajectory.to_rows(trajs, chat.tokenizer)[0]["response_logprobs"] == t.response_logprobs
    plain = run(chat, service, script, max_turns=5, max_response_tokens=2000)["zqa"]
    assert plain.response_logprobs is None and "response_logprobs" not in trajectory.to_rows([plain], chat.tokenizer)[0]
    with pytest.raises(ValueError, match="came back with no log-probs"):
        trajectory.model_turn(t, [5, 6], "stop", chat, trajectory.RolloutLimits(), None)


def test_the_no_tool_ablation_refuses_calls_without_running_them(chat):
    from rstar2.run.steps import ToolDisabled

    t = run(chat, ToolDisabled(), {"zqd": [CALL, ANSWER]}, max_turns=5, max_response_tokens=2000)["zqd"]
    tool_part = chat.tokenizer.decode([i for i, m in zip(t.response_ids, t.loss_mask) if m == 0],
                                      skip_special_tokens=False)
    assert t.tool_statuses == ["error"] and "the Python tool is disabled" in tool_part and "42" not in tool_part


class FakeEngine:
    """A continuous-batching engine stand-in for the agent loop: every submitted turn is answered by the script on
    its own thread after `delay(prompt)` seconds (no batch barrier); it can die or hang after some calls. With
    `logprobs`, a turn's "log-probs" are a function of each token id (-1 - id % 7), so a test sees their alignment."""

    def __init__(self, gen, delay=lambda prompt: 0.005, die_after=None, hang_after=None, logprobs=False):
        self.gen, self.delay, self.die_after, self.hang_after = gen, delay, die_after, hang_after
        self.logprobs = logprobs
        self.pool = ThreadPoolExecutor(32)
        self.calls, self.steps, self.log = 0, 0, []  # log: (event, problem text, time)
        self.priorities: list[int] = []  # of every submitted turn
        self.cancels = 0  # a partial rollout's cut (AgentLoop) asks for it
        self.lock = threading.Lock()

    def submit(self, prompt, max_tokens, seed=None, priority=0):
        with self.lock:
            self.priorities.append(priority)
            self.calls += 1
            calls = self.calls
        self.log.append(("sent", prompt, time.perf_counter()))
        if self.die_after is not None and calls > self.die_after:
            f = Future()
            f.set_exception(RuntimeError("engine actor died"))
            return f
        if self.hang_after is not None and calls > self.hang_after:
            return Future()  # never answers, and its step counter stands still
        return self.pool.submit(self._turn, prompt, max_tokens, seed)

    def _turn(self, prompt, max_tokens, seed):
        time.sleep(self.delay(prompt))
        ids, finish = self.gen([prompt], [max_tokens], [seed])[0]
        with self.lock:
            self.steps += 1
        self.log.append(("back", prompt, time.perf_counter()))
        return ids, finish, self.stats(), [-1.0 - i % 7 for i in ids] if self.logprobs else None

    def stats(self):
        return {"kv_usage": 0.25, "preemptions": 3, "steps": self.steps}

    def probe(self):
        f = Future()
        f.set_result(self.stats())
        return f

    def flush(self):
        pass  # every turn went out with its submit

    def cancel(self):
        self.cancels += 1


def run_sched(chat, service, script, engines, samples=3, policy="kv_aware", cfg=None, seed=None, estimator=None,
              on_done=None, **limits):
    problems = [{"problem_id": k, "prompt": f"question {k}", "answer": "42"} for k in script]
    loop = AgentLoop(EngineSet(engines, [10_000] * len(engines)), cfg or SchedulerCfg(), service, chat,
                     trajectory.RolloutLimits(**limits), policy, estimator, on_done)
    return loop.run(problems, samples, seed)


def assert_exactly_once(trajs, script, samples):
    assert sorted((t.problem_id, t.sample_idx) for t in trajs) == sorted((p, k) for p in script for k in range(samples))
    for t in trajs:
        assert t.done and not t.truncated and t.num_turns == len(script[t.problem_id])
        assert t.tool_statuses == ["ok"] * (len(script[t.problem_id]) - 1)  # no turn ran twice


@pytest.mark.parametrize("policy", ["kv_aware", "least_requests", "round_robin", "static"])
def test_every_policy_rolls_out_the_same_trajectories(chat, service, policy):
    script = {"zqa": [CALL, ANSWER], "zqb": [CALL, CALL, ANSWER], "zqc": [ANSWER]}
    gen = scripted(chat, script)
    engines = [FakeEngine(gen), FakeEngine(gen)]
    done = []
    trajs, stats = run_sched(chat, service, script, engines, policy=policy, max_turns=5, max_response_tokens=2000,
                             on_done=lambda n, total: done.append((n, total)))
    ref = run(chat, service, script, max_turns=5, max_response_tokens=2000)
    assert done == [(n, 9) for n in range(1, 10)]
    prios = Counter(p for e in engines for p in e.priorities)  # of every turn sent
    if policy == "kv_aware":  # its trajectory's start order: 0..8, the same for all of one trajectory's turns
        assert set(prios) == set(range(9)) and sorted(prios.values()) == sorted([2, 3, 1] * 3)
    else:
        assert prios == {0: 18}
    assert len(trajs) == 9 and stats["sched_engine_failures"] == 0
    for t in trajs:
        assert t.response_ids == ref[t.problem_id].response_ids and t.loss_mask == ref[t.problem_id].loss_mask
    assert stats["sched_engine0_dispatched"] + stats["sched_engine1_dispatched"] == 9
    assert stats["sched_engine0_kv_usage_max"] == 0.25 and stats["sched_engine0_preemptions"] == 0  # 3 seen, no new
    assert 1 <= stats["sched_engine0_peak_inflight"] <= 9
    assert stats["sched_tool_wait_s"] > 0 and 0 < stats["sched_engine0_busy"] <= 1


def test_seeded_rollouts_do_not_depend_on_policy_placement_or_failures(chat, service):
    """Each trajectory-turn samples from a seed of its own: every policy, one or two engines, jittered timing and an
    engine dying mid-rollout all give the same trajectories; another seed gives others."""
    script = {"zqa": [CALL, ANSWER], "zqb": [CALL, CALL, ANSWER]}
    gen = scripted(chat, script)
    ref = run_sched(chat, service, script, [FakeEngine(gen)], policy="least_requests", seed=7, max_turns=5,
                    max_response_tokens=2000)[0]
    key = lambda trajs: {(t.problem_id, t.sample_idx): t.response_ids for t in trajs}  # noqa: E731
    jitter = lambda p: 0.001 * (sum(p) % 7)  # noqa: E731
    runs = [run_sched(chat, service, script, engines, policy=policy, seed=7, max_turns=5, max_response_tokens=2000)[0]
            for policy, engines in [("kv_aware", [FakeEngine(gen)]),
                                    ("round_robin", [FakeEngine(gen, jitter), FakeEngine(gen, jitter)]),
                                    ("static", [FakeEngine(gen, jitter), FakeEngine(gen, die_after=2)])]]
    assert all(key(r) == key(ref) for r in runs)
    texts = [chat.tokenizer.decode(t.response_ids) for t in ref]
    seeds = {m for x in texts for m in re.findall(r"<(\d+)>", x)}
    assert len(seeds) == sum(t.num_turns for t in ref)  # a seed per trajectory-turn: samples and turns differ
    other = run_sched(chat, service, script, [FakeEngine(gen)], seed=8, max_turns=5, max_response_tokens=2000)[0]
    assert all(key(other)[k] != v for k, v in key(ref).items())


def test_turn_requests_are_the_turns_the_loop_sent(chat, service):
    """A trajectory's model turns, rebuilt from its tokens and loss mask (for a replay without tools), are exactly
    the (context, max_tokens, seed) requests the agent loop sent."""
    script = {"zqa": [CALL, ANSWER], "zqb": [CALL, CALL, ANSWER], "zqc": [ANSWER]}
    gen, sent = scripted(chat, script), []

    def logged(prompts, max_tokens, seeds):
        sent.extend(zip(map(list, prompts), max_tokens, seeds))
        return gen(prompts, max_tokens, seeds)

    trajs, _ = run_sched(chat, service, script, [FakeEngine(logged)], samples=2, seed=3, max_turns=5,
                         max_response_tokens=2000)
    rebuilt = [r for t in trajs for r in t.turn_requests()]
    assert sorted(rebuilt) == sorted(sent) and len(sent) == 2 * (2 + 3 + 1)
    assert [len(t.turn_requests()) for t in trajs] == [t.num_turns for t in trajs]


def test_turns_arrive_continuously_no_barrier(chat, service):
    """One engine: a slow one-turn trajectory is generating while another runs all three of its turns and two tool
    calls. With a per-call barrier, the second trajectory's next turn would wait for the slow one."""
    script = {"zqslow": [ANSWER], "zqfast": [CALL, CALL, ANSWER]}
    eng = FakeEngine(scripted(chat, script), delay=lambda p: 1.5 if "zqslow" in chat.tokenizer.decode(p) else 0.005)
    trajs, _ = run_sched(chat, service, script, [eng], samples=1, policy="least_requests", max_turns=5,
                         max_response_tokens=2000)
    assert_exactly_once(trajs, script, 1)
    slow_back = next(t for ev, p, t in eng.log if ev == "back" and "zqslow" in chat.tokenizer.decode(p))
    fast_sent = [t for ev, p, t in eng.log if ev == "sent" and "zqfast" in chat.tokenizer.decode(p)]
    assert len(fast_sent) == 3 and fast_sent[-1] < slow_back


def test_scheduled_rollout_survives_an_engine_failure(chat, service):
    """Engine 1 dies on its second call: its trajectories are requeued to engine 0, each finishes exactly once."""
    script = {"zqa": [CALL, ANSWER], "zqb": [CALL, CALL, ANSWER]}
    gen = scripted(chat, script)
    trajs, stats = run_sched(chat, service, script, [FakeEngine(gen), FakeEngine(gen, die_after=1)], samples=4,
                             max_turns=5, max_response_tokens=2000)
    assert stats["sched_engine_failures"] == 1 and stats["sched_requeued"] > 0
    assert_exactly_once(trajs, script, 4)


@pytest.mark.parametrize("policy", ["kv_aware", "round_robin"])
def test_a_hung_engine_is_declared_dead_and_its_trajectories_requeued(chat, service, policy):
    """Engine 1 stops answering turns after its third (its probes still answer, but its step counter stands
    still): after hang_timeout_s it is dead, its trajectories resume on engine 0, each finishes exactly once."""
    script = {"zqa": [CALL, ANSWER], "zqb": [CALL, CALL, ANSWER]}
    gen = scripted(chat, script)
    cfg = SchedulerCfg(hang_timeout_s=0.4, probe_interval_s=0.05)
    t0 = time.perf_counter()
    trajs, stats = run_sched(chat, service, script, [FakeEngine(gen), FakeEngine(gen, hang_after=3)], samples=4,
                             policy=policy, cfg=cfg, max_turns=5, max_response_tokens=2000)
    assert time.perf_counter() - t0 < 5
    assert stats["sched_engine_failures"] == 1 and stats["sched_requeued"] > 0
    assert_exactly_once(trajs, script, 4)


def test_an_engine_that_answers_no_probe_is_dead(chat, service):
    script = {"zqa": [CALL, ANSWER]}
    gen = scripted(chat, script)
    mute = FakeEngine(gen, hang_after=0)
    mute.probe = lambda: Future()  # the whole process is frozen
    trajs, stats = run_sched(chat, service, script, [mute, FakeEngine(gen)], samples=4,
                             cfg=SchedulerCfg(hang_timeout_s=0.3, probe_interval_s=0.05), max_turns=5,
                             max_response_tokens=2000)
    assert stats["sched_engine_failures"] == 1 and "probe" in stats["sched_failures"][0]["error"]
    assert_exactly_once(trajs, script, 4)


def test_the_scheduler_hears_each_turn_as_it_ends(chat, service, monkeypatch):
    """The scheduler gets a trajectory's length the moment a turn ends: when it leaves for a tool, its footprint holds
    the turn just generated (the KV vLLM keeps cached for it), and when it finishes, the length estimate learns its
    whole response and every turn (a one-turn trajectory too: its length and one turn, not 0 and 0)."""
    from rstar2.rollout.estimator import LengthEstimator
    from rstar2.rollout.scheduler import Scheduler

    away_at: dict[int, list[int]] = {}
    at_tool = Scheduler.at_tool

    def spy(self, tid, away):
        if away:
            away_at.setdefault(tid, []).append(self.trajs[tid].response_len)
        at_tool(self, tid, away)

    monkeypatch.setattr(Scheduler, "at_tool", spy)
    script = {"zqa": [CALL, ANSWER], "zqb": [CALL, CALL, ANSWER], "zqc": [ANSWER]}
    est = LengthEstimator()
    trajs, _ = run_sched(chat, service, script, [FakeEngine(scripted(chat, script))], samples=2, estimator=est,
                         max_turns=5, max_response_tokens=2000)
    est.commit()
    assert sorted(est._ref) == sorted((len(t.response_ids), t.num_turns) for t in trajs)
    assert {t.num_turns for t in trajs} == {1, 2, 3}
    for tid, t in enumerate(trajs):  # a tool reply starts where the loss mask turns from 1 to 0
        tool_starts = [i for i in range(1, len(t.loss_mask)) if t.loss_mask[i - 1] and not t.loss_mask[i]]
        assert away_at.get(tid, []) == tool_starts
