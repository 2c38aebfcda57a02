"""Normalisation of problems and answers, and the paper's RL filter: integer answers only (§4.1: its reward is then
reliable). Pure functions over strings; the importer and world loading apply them to tables."""

from __future__ import annotations

import re

from rstar2.data.answers import last_boxed

_INT = re.compile(r"^[+-]?\d+$")
_THOUSANDS = re.compile(r"^[+-]?\d{1,3}(,\d{3})+$")
_WRAPPERS = (r"\text{", r"\textbf{", r"\mathrm{", r"\mathbf{")


def normalise_text(text: str) -> str:
    """Whitespace runs become one space (newlines kept as one newline), ends stripped."""
    lines = [re.sub(r"[ \t\r\f\v]+", " ", line).strip() for line in text.strip().splitlines()]
    return "\n".join(line for i, line in enumerate(lines) if line or (i and lines[i - 1]))


def normalise_answer(answer: str) -> str:
    """A reference answer in its plain form: `\\boxed{12}` -> `12`, `$12$` -> `12`, `042` -> `42`, `1,000` -> `1000`,
    `+5` -> `5`, `12.0` -> `12`; anything that is not an integer keeps its LaTeX (whitespace-stripped)."""
    a = answer.strip()
    inner = last_boxed(a)
    if inner is not None and a == f"\\boxed{{{inner}}}":  # the whole answer is one box
        a = inner.strip()
    a = a.strip("$").strip()
    for w in _WRAPPERS:
        if a.startswith(w) and a.endswith("}"):
            a = a[len(w):-1].strip()
    plain = a.replace("{,}", ",").replace("\\!", "").replace("\\,", "")
    if _THOUSANDS.match(plain):
        plain = plain.replace(",", "")
    plain = re.sub(r"^([+-]?\d+)\.0+$", r"\1", plain)
    if _INT.match(plain):
        return str(int(plain))
    return a


def is_integer(answer: str) -> bool:
    """Whether a normalised answer is an integer (the paper keeps only these for RL)."""
    return bool(_INT.match(answer))


def matches(pred: str | None, gold: str, answer_type: str) -> float:
    """Exact checks of the answer types that need no Math-Verify: integer (the same integer after normalisation:
    `042`, `\\boxed{42}`, `42.0` all match 42) and choice (the option letter, as `B`, `(B)` or `\\text{B}`).
    1.0 or 0.0."""
    if pred is None:
        return 0.0
    p, g = normalise_answer(pred), normalise_answer(gold)
    if answer_type == "integer":
        return float(is_integer(p) and is_integer(g) and int(p) == int(g))
    if answer_type == "choice":
        m = re.match(r"^\(?([A-Za-z])\)?[.:]?(\s|$)", p)
        return float(m is not None and m.group(1).upper() == g.strip().upper())
    raise ValueError(f"no exact check for answer type {answer_type!r} (math answers go through Math-Verify)")
