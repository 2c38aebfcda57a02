"""The token stream against the model's own template (rstar2.rollout.stream_check): trajectories built turn by turn as
the agent loop builds them pass on the tiny world's template, on a Qwen3-style one (which drops earlier turns'
thinking) and on SmolLM2-135M-Instruct's real tokenizer with the Hermes tool template (rstar2.models.tools), with
tool calls in unicode and escaped JSON, a reply in unicode, a broken call and a truncated end; a shifted token, a
tool turn written without the template's separator and a prompt of another question are each caught, with where."""

import dataclasses

import pytest

from rstar2.rollout import stream_check, trajectory
from rstar2.rollout.chat import ChatFormat
from rstar2.sandbox import ExecResult
from rstar2.world import tokenizer as tiny_tokenizer
from tests.fixtures.qwen import make_tokenizer

QUESTION = "Compute 6 * 7 — and print «ü»."
LIMITS = trajectory.RolloutLimits(max_turns=6, max_response_tokens=4000, tool_response_chars=256)
CODE = 'print("é \\"q\\" ü\\n", input())'  # a quote, a backslash escape and non-ASCII in the JSON arguments


@pytest.fixture(scope="module", params=["tiny", "qwen3", "smollm2"])
def chat(request, tmp_path_factory):
    if request.param == "tiny":
        corpus = ["What is 6 * 7? <reason> use python </reason> print(6 * 7) stdout: 42 é ü «»"] * 20
        tok = tiny_tokenizer.train(corpus, 400, tmp_path_factory.mktemp("tiny-tok"))
    elif request.param == "smollm2":  # a real instruct model's tokenizer, its tool markers added (rstar2.models)
        return ChatFormat.load(request.getfixturevalue("smollm2_dir"))
    else:
        tok = make_tokenizer()
    return ChatFormat.of(tok, request.param)


def ok(stdout: str) -> ExecResult:
    return ExecResult("ok", stdout, "", 0, 0.01, 0.01)


def rolled(chat: ChatFormat, turns: list[tuple[str, ExecResult | None]], tool_turn=None) -> trajectory.Trajectory:
    """One trajectory through the loop's own steps: each (model text, the sandbox's answer to its call)."""
    t = trajectory.make_trajs(chat, [{"problem_id": "p1", "prompt": QUESTION, "answer": "42"}], 1, LIMITS)[0]
    for text, res in turns:
        pending = trajectory.model_turn(t, chat.encode(text), "stop", chat, LIMITS)
        if pending is None:
            break
        if pending.request is not None:
            trajectory.tool_result(pending, res, LIMITS)
        (tool_turn or trajectory.tool_turn)(pending, chat)
    return t


def script(chat: ChatFormat) -> list[tuple[str, ExecResult | None]]:
    call = chat.assistant_turn("\nuse python «ü»\n</reason>\n", CODE, "naïve")
    broken = f'\n</reason>\n{chat.tool_call_open}\n{{"name": oops}}\n{chat.tool_call_close}{chat.end_of_turn}'
    answer = chat.assistant_turn("\ndone\n</reason>\n<answer>\\boxed{42}</answer>")
    return [(call, ok("é \"q\" ü\n naïve\n")), (broken, None), (call, ok("42\n")), (answer, None)]


def test_what_the_loop_appends_is_what_the_template_writes(chat):
    t = rolled(chat, script(chat))
    assert t.tool_statuses == ["ok", "parse_error", "ok"] and t.done and not t.truncated
    assert len(stream_check.appended_runs(t.loss_mask)) == 3
    assert stream_check.mismatch(t, QUESTION, chat) is None
    assert stream_check.check([t, t], {"p1": QUESTION}, chat) == 2


def test_a_truncated_trajectory_checks_the_turns_it_has(chat):
    s = script(chat)
    t = rolled(chat, s[:3] + [(s[0][0], ok("x" * 300))])  # the last call's reply is cut to tool_response_chars
    assert stream_check.mismatch(t, QUESTION, chat) is None


def test_a_shifted_token_is_caught_with_where(chat):
    t = rolled(chat, script(chat))
    a, b = stream_check.appended_runs(t.loss_mask)[1]
    t.response_ids[a + 2] += 1
    why = stream_check.mismatch(t, QUESTION, chat)
    assert why is not None and "tool turn 2" in why and "at token 2" in why
    with pytest.raises(stream_check.StreamMismatch, match=f"{chat.source}: trajectory p1/0: tool turn 2"):
        stream_check.check([t], {"p1": QUESTION}, chat)


def test_a_prompt_of_another_question_is_caught(chat):
    t = rolled(chat, script(chat))
    assert "the prompt differs" in stream_check.mismatch(t, QUESTION + " ", chat)


def test_a_tool_turn_without_the_templates_separator_is_caught(chat):
    """The probe's tool turn with the newline after the reply dropped: what a format that lost a separator writes."""
    lossy = dataclasses.replace(chat, tool_tail=chat.tool_tail.replace("\n", "", 1))
    t = rolled(chat, script(chat), tool_turn=lambda p, _: trajectory.tool_turn(p, lossy))
    assert "tool turn 1" in stream_check.mismatch(t, QUESTION, chat)



def test_a_real_models_whole_stream_is_its_full_render(smollm2_dir):
    """SmolLM2 with the tool template (which rewrites no earlier turn): the ids the loop accumulated over three model
    turns and two tool turns are the tokenizer's ids of the whole conversation rendered at once, token for token, less
    what the template writes after each assistant turn's end-of-turn token (a newline), which the model never
    generates: it stops on the token and the next header follows (rstar2.rollout.chat)."""
    from rstar2.rollout.chat import prompt_messages, tool_call
    from rstar2.rollout.tool_parser import format_tool_response

    chat = ChatFormat.load(smollm2_dir)
    said = [("<reason>\nThe numbers are 6, 7.\n</reason>", "x1 = 6 * 7\nprint(x1)", ok("42\n")),
            ("<reason>\nCheck it «ü».\n</reason>", 'print(42 == 6 * 7, "naïve")', ok("True naïve\n")),
            ("<reason>\nDone.\n</reason>\n<answer>\\boxed{42}</answer>", None, None)]
    t = rolled(chat, [(chat.assistant_turn(text, code), res) for text, code, res in said])
    messages = prompt_messages(QUESTION)
    for text, code, res in said:
        messages.append({"role": "assistant", "content": text, **({"tool_calls": [tool_call(code)]} if code else {})})
        if res is not None:
            messages.append({"role": "tool", "content": format_tool_response(res, LIMITS.tool_response_chars)})
    full, stream, start = chat.render(messages), "", 0
    for i in [i for i, m in enumerate(messages) if m["role"] == "assistant"]:
        through = chat.render(messages[:i + 1])
        assert full.startswith(through) and through.endswith(chat.end_of_turn + chat.turn_sep)
        stream, start = stream + full[start:len(through) - len(chat.turn_sep)], len(through)
    assert start == len(full) and chat.turn_sep == "\n"
    assert t.prompt_ids + t.response_ids == chat.encode(stream)
    assert t.tool_statuses == ["ok", "ok"] and t.done
