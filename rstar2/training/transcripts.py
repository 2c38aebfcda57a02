"""SFT transcripts in the common messages layout, one JSON object a line:

    {"messages": [{"role": "system" | "user" | "assistant" | "tool", "content": "...",
                   "tool_calls": [{"type": "function", "function": {"name": "...", "arguments": {...}}}]}, ...]}

`tool_calls` is optional (assistant messages only). Other keys of a row are kept and ignored by SFT (the tiny world
adds problem_id and mode). Arguments given as a JSON string (OpenAI's layout) are decoded, so every chat template
sees an object. A row that breaks the layout is one clear error naming the file, the line and what is wrong.
"""

from __future__ import annotations

import json
from pathlib import Path

ROLES = ("system", "user", "assistant", "tool")


def write(rows: list[dict], path: str | Path) -> None:
    """Rows (each with "messages") as JSON lines."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def read(path: str | Path) -> list[list[dict]]:
    """The messages of every transcript in `path` (blank lines skipped), checked and normalised."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(_messages(json.loads(line)))
            except ValueError as e:  # JSONDecodeError is a ValueError
                raise ValueError(f"{path}:{n}: {e}") from None
    if not out:
        raise ValueError(f"{path}: no transcripts (expected JSON lines with a 'messages' list)")
    return out


def _messages(row) -> list[dict]:
    msgs = row.get("messages") if isinstance(row, dict) else None
    if not isinstance(msgs, list) or not msgs:
        raise ValueError("expected an object with a non-empty 'messages' list")
    out = [_message(m, i) for i, m in enumerate(msgs)]
    first = next((i for i, m in enumerate(out) if m["role"] == "assistant"), None)
    if first is None:
        raise ValueError("no assistant message (nothing to train on)")
    if first == 0:
        raise ValueError("message 0 is an assistant message; a prompt (user message) must come first")
    return out


def _message(m, i: int) -> dict:
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise ValueError(f"message {i}: expected an object whose 'role' is one of {ROLES}")
    calls = m.get("tool_calls") or []
    content = m.get("content")
    if not isinstance(content, str) and not (content is None and calls):
        raise ValueError(f"message {i} ({m['role']}): 'content' must be a string")
    if calls and m["role"] != "assistant":
        raise ValueError(f"message {i} ({m['role']}): only assistant messages carry 'tool_calls'")
    if not isinstance(calls, list):
        raise ValueError(f"message {i}: 'tool_calls' must be a list")
    out = {**m, "content": content or ""}
    if calls:
        out["tool_calls"] = [_call(c, i) for c in calls]
    return out


def _call(c, i: int) -> dict:
    f = c.get("function", c) if isinstance(c, dict) else None
    args = f.get("arguments") if isinstance(f, dict) else None
    if isinstance(args, str):
        args = json.loads(args)
    if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not isinstance(args, dict):
        raise ValueError(f"message {i}: a tool call needs {{'function': {{'name': str, 'arguments': object}}}}")
    return {"type": "function", "function": {"name": f["name"], "arguments": args}}
