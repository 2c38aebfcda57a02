"""The token stream against the model's own chat template: what the agent loop appended must be what the template
writes.

The loop is token-in/token-out: a trajectory is the prompt ids, then the model's turns as sampled (loss mask 1) and the
tool turns the loop appends between them (loss mask 0: the tool's reply and the next generation prompt, from
rstar2.rollout.chat.ChatFormat's probe of the template). The trainer learns from exactly these ids, so an appended
token the template would not write (a separator the probe missed, a reply rendered another way, a shifted id) trains
the model on a stream it never sees at inference. For a trajectory and its problem's text, with E the end-of-turn
token and S what the template writes after it:

    prompt ids       = encode(render(system, user(question)) + generation prompt)
    tool turn k ids  = encode(R_k[after the n_k-th E and S:])
        R_k = render(messages through tool message k) + generation prompt
        n_k = count of E in render(messages through assistant turn k)

Only what each turn appends is compared, never the model's own turns, so a template that rewrites earlier turns
(Qwen3 drops the thinking of earlier assistant turns) is checked as well as one that does not. The loop sends one tool
message per model turn (the first call, as released), so no two tool messages follow each other in its streams; SFT
transcripts that have them are rendered by the template itself (ChatFormat.segments).
"""

from __future__ import annotations

from rstar2.rollout.chat import ChatFormat, after_turns, prompt_messages
from rstar2.rollout.template import TOOL_NAME
from rstar2.rollout.tool_parser import parse_tool_calls
from rstar2.rollout.trajectory import Trajectory


class StreamMismatch(ValueError):
    """A trajectory's token ids differ from what the model's chat template writes."""


def appended_runs(loss_mask: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each run of loss mask 0 in a response: the tool turns the loop appended, in order."""
    runs, start = [], None
    for i, m in enumerate(loss_mask + [1]):
        if not m and start is None:
            start = i
        elif m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def assistant_message(text: str, chat: ChatFormat) -> dict:
    """The assistant message a model turn's text stands for: its words before the first tool-call marker and the
    calls it decodes to (none when they do not decode: the template renders no call then)."""
    text = text.split(chat.end_of_turn)[0]
    parsed = parse_tool_calls(text, chat.tool_call_open, chat.tool_call_close)
    if parsed.error is not None or not parsed.calls:
        return {"role": "assistant", "content": text}
    calls = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in parsed.calls]
    return {"role": "assistant", "content": text.split(chat.tool_call_open)[0], "tool_calls": calls}


def mismatch(traj: Trajectory, question: str, chat: ChatFormat) -> str | None:
    """Where `traj`'s appended ids first differ from the template's rendering of its messages (see the module
    docstring), as one line; None when every appended token is the template's. Each tool turn is rendered with the
    messages up to it, as the loop saw them: one render of the whole conversation would not do, since a template may
    write earlier turns differently once later ones follow (two renders a turn, ~1.5 ms a tiny-world trajectory)."""
    name = f"trajectory {traj.problem_id}/{traj.sample_idx}"
    want = chat.encode(chat.prompt(question))
    if traj.prompt_ids != want:
        return _diff(f"{name}: the prompt", traj.prompt_ids, want, chat)
    messages = prompt_messages(question)
    for k, (a, b) in enumerate(appended_runs(traj.loss_mask)):
        if k >= len(traj.tool_replies) or k >= len(traj.assistant_turns):
            return f"{name}: tool turn {k + 1} has no tool reply or model turn before it"
        messages += [assistant_message(traj.assistant_turns[k], chat),
                     {"role": "tool", "name": TOOL_NAME, "content": traj.tool_replies[k]}]
        n = chat.render(messages[:-1]).count(chat.end_of_turn)
        full = chat.render(messages, add_generation_prompt=True)
        try:
            start = after_turns(full, n, chat.end_of_turn, chat.turn_sep)
        except ValueError as e:
            return f"{name}: the template's rendering of tool turn {k + 1} cannot be found ({e})"
        got = traj.response_ids[a:b]
        want = chat.encode(full[start:])
        if got != want:
            return _diff(f"{name}: tool turn {k + 1} (response tokens {a}-{b})", got, want, chat)
    return None


def check(trajs: list[Trajectory], questions: dict[str, str], chat: ChatFormat) -> int:
    """Every trajectory's appended ids against the template (`questions`: problem id -> problem text); raises
    StreamMismatch naming the first that differs. Returns how many trajectories were checked."""
    for t in trajs:
        if (why := mismatch(t, questions[t.problem_id], chat)) is not None:
            raise StreamMismatch(f"{chat.source}: {why}")
    return len(trajs)


def sample(trajs: list[Trajectory], n: int) -> list[Trajectory]:
    """The `n` trajectories a step checks: those with the most tool turns (the most appended text), in a fixed order."""
    return sorted(trajs, key=lambda t: (-len(t.tool_replies), t.problem_id, t.sample_idx))[:max(n, 0)]


def _diff(what: str, got: list[int], want: list[int], chat: ChatFormat) -> str:
    i = next((j for j, (g, w) in enumerate(zip(got, want)) if g != w), min(len(got), len(want)))

    def show(ids: list[int]) -> str:
        return repr(chat.tokenizer.decode(ids[max(0, i - 3):i + 4], skip_special_tokens=False))

    return (f"{what} differs from the chat template's at token {i} ({len(got)} tokens in the stream, {len(want)} in "
            f"the template's): stream {show(got)}, template {show(want)}")

