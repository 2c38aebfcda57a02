"""Answer parsing that needs no sandbox: the last `\\boxed{}` of a text (what data cleaning, layout readers and
the reward all read an answer by)."""

from __future__ import annotations

_BOXED = "\\boxed{"


def last_boxed(text: str) -> str | None:
    """Content of the last top-level, brace-balanced `\\boxed{...}` (`\\{`, `\\}` are literal braces)."""
    found, i = None, 0
    while (start := text.find(_BOXED, i)) >= 0:
        depth, j = 1, start + len(_BOXED)
        while j < len(text) and depth:
            if text[j] == "\\":
                j += 1
            elif text[j] in "{}":
                depth += 1 if text[j] == "{" else -1
            j += 1
        if depth:  # unbalanced: nothing after it can close either
            break
        found, i = text[start + len(_BOXED):j - 1], j
    return found
