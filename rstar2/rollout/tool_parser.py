"""Hermes-style tool calls in one assistant turn, and the text the model sees back.
The markers around a call (`<tool_call>`/`</tool_call>` for Qwen) come from the model's chat template
(rstar2.rollout.chat.ChatFormat).

Following the released agent loop, nothing the model writes ends a trajectory: a call that cannot be decoded
becomes the tool response "Failed to decode tool call: ...", and an unknown tool or bad arguments become
"Error when executing tool: ...". The rollout loop decides how many of the parsed calls it executes
(released default: the first one).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache

from rstar2.rollout.template import TOOL_NAME
from rstar2.sandbox import OK, ExecRequest, ExecResult

TRUNCATED = "...(truncated)..."
# an object's address in CPython's default repr (`<function f at 0x7f3a...>`): where the sandbox's allocator put it,
# which differs from one executor process to the next; the model sees one fixed address instead
OBJECT_ADDRESS = re.compile(r"(?<= at )0x[0-9a-f]{6,16}(?=>)")
HIDDEN_ADDRESS = "0x7f0000000000"


@dataclass
class ToolCall:
    name: str
    arguments: dict


@dataclass
class ParsedTurn:
    calls: list[ToolCall]
    error: str | None  # "Failed to decode tool call: ...", to be sent back as the tool response


def _decode(block: str) -> ToolCall:
    obj = json.loads(block)
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    for key in ("name", "arguments"):
        if key not in obj:
            raise ValueError(f"missing key {key!r}")
    name, args = obj["name"], obj["arguments"]
    if not isinstance(name, str):
        raise ValueError(f"'name' must be a string, got {type(name).__name__}")
    if isinstance(args, str):  # some models double-encode the arguments
        args = json.loads(args)
    if not isinstance(args, dict):
        raise ValueError(f"'arguments' must be an object, got {type(args).__name__}")
    return ToolCall(name, args)


@lru_cache(maxsize=8)
def _block(open_: str, close: str) -> re.Pattern:
    return re.compile(re.escape(open_) + r"(.*?)" + re.escape(close), re.DOTALL)


def parse_tool_calls(turn_text: str, open_: str, close: str) -> ParsedTurn:
    """All `<open>{json}<close>` blocks of one assistant turn, in order. The first failure stops parsing; the calls
    decoded before it are kept. No `<open>` at all: no calls and no error."""
    if open_ not in turn_text:
        return ParsedTurn([], None)
    calls: list[ToolCall] = []
    end = 0
    try:
        for m in _block(open_, close).finditer(turn_text):
            calls.append(_decode(m.group(1)))
            end = m.end()
        if open_ in turn_text[end:]:
            raise ValueError(f"{open_} without a closing {close}")
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError; deep nesting recurses
        return ParsedTurn(calls, f"Failed to decode tool call: {e}")
    return ParsedTurn(calls, None)


def tool_call_to_request(call: ToolCall) -> ExecRequest | str:
    """The sandbox request for a call of the Python tool, or the error text to send back instead."""
    if call.name != TOOL_NAME:
        return f"Error when executing tool: unknown tool {call.name!r}; the only tool is {TOOL_NAME!r}"
    code, stdin = call.arguments.get("code"), call.arguments.get("input", "")
    if not isinstance(code, str):
        return "Error when executing tool: argument 'code' must be a string of Python code"
    if stdin is None:
        stdin = ""
    if not isinstance(stdin, str):
        return "Error when executing tool: argument 'input' must be a string"
    return ExecRequest(code=code, stdin=stdin)


def truncate_middle(text: str, max_chars: int) -> str:
    """At most `max_chars` characters: head and tail kept, `...(truncated)...` between (released: middle)."""
    if len(text) <= max_chars:
        return text
    keep = max(0, max_chars - len(TRUNCATED))
    head, tail = keep - keep // 2, keep // 2
    return text[:head] + TRUNCATED + (text[-tail:] if tail else "")


def format_tool_response(result: ExecResult, max_chars: int = 512) -> str:
    """The text inside `<tool_response>`. No timings, and objects' addresses all the same (OBJECT_ADDRESS): both
    would only be token noise for the model, and would make a rollout depend on which executor process ran it."""
    if result.status == OK:
        text = f"Tool call success\nstdout: {result.stdout}"
    else:
        text = f"Tool call failure\nreason: {result.status}\nstdout: {result.stdout}\nstderr: {result.stderr}"
    return truncate_middle(OBJECT_ADDRESS.sub(HIDDEN_ADDRESS, text), max_chars)
