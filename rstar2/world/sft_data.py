"""Non-reasoning SFT transcripts that teach the format and the tool protocol (paper §4.1), deliberately noisy.

A real SFT'd policy is not clean: it sometimes answers without the tool (usually wrong), writes buggy code and fixes it
after a traceback, or slips on the answer format. That noise is what GRPO-RoC exists to clean up, so the mix is
configurable. Two buggy modes: `buggy_fix` (the `tiny` preset's: its tool reply is the error's last line alone, which
the sandbox never sends, and the model SFT'd on it does not recover in RL) and `recover` (a typo'd `print`, answered
with the very failure reply the sandbox sends for it, traceback included; the reflection names the mistake and the
next call fixes it: the recovery that the `tiny-recovery` preset's RL acts on). Each transcript is a conversation in
the common messages layout (system, user, assistant with `tool_calls`, tool), rendered for SFT with the world's chat
template like any model's (rstar2.rollout.chat, rstar2.training.sft).
"""

from __future__ import annotations

import builtins
import linecache
import random
import re
import traceback

import polars as pl

from rstar2.rollout.chat import prompt_messages, tool_call
from rstar2.rollout.template import ANSWER_CLOSE, ANSWER_OPEN, REASON_CLOSE, REASON_OPEN
from rstar2.rollout.tool_parser import format_tool_response
from rstar2.sandbox import ExecResult
from rstar2.sandbox.zygote import CODE_NAME

MODES = ("clean", "buggy_fix", "recover", "no_tool", "format_slip")
TYPO = "prnt"  # the recover mode's mistake: a typo'd print, which the NameError's last line names

_USE_TOOL = "I will compute this with Python."
_NO_TOOL = "I can compute this directly."


def _restate(prompt: str) -> str:
    """Reasoning that first restates the problem's numbers. Copying a number twice, the second time from a nearby
    ordered list, is learned ~600 SFT steps earlier than copying straight into code (measured on the tiny world)."""
    nums = re.findall(r"\d+(?:\.\d+)?", prompt)  # 0.25 as one number (the tiny world's prompts have no decimals)
    return f"The number is {nums[0]}." if len(nums) == 1 else f"The numbers are {', '.join(nums)}."


def _ok(stdout: str) -> str:
    return format_tool_response(ExecResult("ok", stdout + "\n", "", 0, 0.0, 0.0))


def _err(stderr: str, max_chars: int = 512) -> str:
    return format_tool_response(ExecResult("error", "", stderr, 1, 0.0, 0.0), max_chars)


def _bug(code: str, r: random.Random) -> tuple[str, str]:
    """A plausible first attempt that fails, and the error the sandbox reports for it."""
    kind = r.choice(["name", "syntax"])
    if kind == "name" and "print(" in code:
        return code.replace("print(", "print(x + ", 1), "NameError: name 'x' is not defined"
    return code.rstrip(")"), "SyntaxError: '(' was never closed"


def typo(code: str) -> tuple[str, str]:
    """The recover mode's first attempt (the first `print` misspelt) and the stderr the sandbox sends for it: the
    traceback this interpreter formats for the snippet run as the sandbox runs it (file `<code>`, its lines shown),
    so SFT shows exactly the reply RL will get (tests/unit/test_sft_data.py checks it against the real sandbox). The
    snippet fails on the typo, before anything else runs: our own generator's code, run in-process like
    problems.solve."""
    bad = code.replace("print(", f"{TYPO}(", 1)
    linecache.cache[CODE_NAME] = (len(bad), None, bad.splitlines(True), CODE_NAME)
    try:
        exec(compile(bad, CODE_NAME, "exec"), {"__builtins__": builtins})  # noqa: S102 - generator-authored code
    except NameError as e:
        return bad, "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next))  # from <code>'s frame
    finally:
        linecache.cache.pop(CODE_NAME, None)
    raise ValueError(f"solution code without a print call to misspell: {code!r}")


def _answer(answer: str) -> str:
    return f"{ANSWER_OPEN}\nThe answer is \\boxed{{{answer}}}.\n{ANSWER_CLOSE}"


def transcript(prompt: str, answer: str, code: str, mode: str, r: random.Random, system: bool = True,
               tool_chars: int = 512, opens_reason: bool = True) -> list[dict]:
    """The messages of one SFT example for `mode` (one of MODES). Assistant turns continue the `<reason>` block the
    world's generation prompt opens (`opens_reason`; else each turn opens it itself); `tool_chars` is the rollout's cap
    on a tool reply (rollout.tool_response_chars), so the recover mode's failure reply is the one RL would show."""
    msgs = prompt_messages(prompt, system)

    def say(content: str, call: str | None = None) -> None:
        if not opens_reason:  # the template's generation prompt does not open <reason>: the turn does
            content = REASON_OPEN + (content.rstrip("\n") if call else content)
        msgs.append({"role": "assistant", "content": content, **({"tool_calls": [tool_call(call)]} if call else {})})

    def tool(text: str) -> None:
        msgs.append({"role": "tool", "content": text})

    restated = _restate(prompt)
    if mode == "no_tool":
        say(f"\n{restated} {_NO_TOOL}\n{REASON_CLOSE}\n{_answer(answer)}")
        return msgs
    if mode == "buggy_fix":
        bad, err = _bug(code, r)
        say(f"\n{restated} {_USE_TOOL}\n{REASON_CLOSE}\n", bad)
        tool(_err(err))
        say(f"\nThe code failed. I will fix it.\n{REASON_CLOSE}\n", code)
    elif mode == "recover":
        bad, stderr = typo(code)
        say(f"\n{restated} {_USE_TOOL}\n{REASON_CLOSE}\n", bad)
        tool(_err(stderr, tool_chars))
        say(f"\nThe code failed: {TYPO} is not defined. I will use print.\n{REASON_CLOSE}\n", code)
    else:
        say(f"\n{restated} {_USE_TOOL}\n{REASON_CLOSE}\n", code)
    tool(_ok(answer))
    closing = f"\nThe code printed the result.\n{REASON_CLOSE}\n"
    if mode == "format_slip":
        slip = r.choice(["no_tags", "no_box", "twice"])
        if slip == "no_tags":  # no <answer> block: reward 0, p_format 1
            say(f"{closing}The answer is \\boxed{{{answer}}}.")
        elif slip == "no_box":  # nothing to extract: reward 0
            say(f"{closing}{ANSWER_OPEN}\nThe answer is {answer}.\n{ANSWER_CLOSE}")
        else:  # two answer blocks: still correct, but p_format > 0
            say(f"{closing}{ANSWER_OPEN}\n{answer}\n{ANSWER_CLOSE}\n{_answer(answer)}")
        return msgs
    say(f"{closing}{_answer(answer)}")
    return msgs


def build(problems: pl.DataFrame, mix: dict[str, float], seed: int, system_frac: float = 1.0,
          mix_by_kind: dict[str, dict[str, float]] | None = None, tool_chars: int = 512,
          opens_reason: bool = True) -> list[dict]:
    """One transcript per problem row, modes drawn from `mix` (weights need not sum to 1), or from
    `mix_by_kind[source]` for the kinds it names: a real SFT'd policy's noise is not uniform (it trusts itself on
    problems that look easy). A `system_frac` share carries the system prompt. Leaving it out of most SFT examples
    halves their length, so a CPU budget sees twice the examples; the format and tool protocol do not depend on it.
    `tool_chars`, `opens_reason`: see `transcript`."""
    mixes = {None: _checked(mix), **{k: _checked(m) for k, m in (mix_by_kind or {}).items()}}
    r = random.Random(seed)
    rows = []
    for p in problems.iter_rows(named=True):
        modes, weights = mixes.get(p.get("source"), mixes[None])
        mode = r.choices(modes, weights)[0]
        msgs = transcript(p["prompt"], p["answer"], p["solution_code"], mode, r, system=r.random() < system_frac,
                          tool_chars=tool_chars, opens_reason=opens_reason)
        rows.append(dict(problem_id=p["problem_id"], mode=mode, messages=msgs))
    return rows


def _checked(mix: dict[str, float]) -> tuple[tuple[str, ...], tuple[float, ...]]:
    unknown = set(mix) - set(MODES)
    if unknown or not any(w > 0 for w in mix.values()):
        raise ValueError(f"SFT mix must weight some of {MODES}; got {mix}")
    modes, weights = zip(*[(m, w) for m, w in mix.items() if w > 0])
    return modes, weights
