"""Training health: one line per RL step for the terminal, and the collapse alert.

An agentic-RL run that collapses shows it first in how the policy uses its environment, before the reward falls:
more malformed answers and more failing tool calls (in a recorded run the format-violation rate went 0.12 -> 0.51
and the tool-error rate 0.09 -> 0.69 over steps 4-10, after the reward peaked at step 4). The alert watches those two
rates:

    fire(m, t)  ⇔  x_m(t) ≥ factor · b  and  x_m(t) - b ≥ floor,      b = min(x_m(t-window), ..., x_m(t-1))

i.e. the rate at least doubled (factor 2) within the last `window` (3) steps, by at least `floor` (0.05) in absolute
terms. Against the minimum of the window, so a rise spread over up to three steps still counts. The floor keeps
noise from firing it: at the tiny preset's 256 trajectories a step a rate of 0.02 has a binomial standard error of
~0.009, so 0.01 -> 0.03 means nothing, while 5 points of the batch turning bad is worth a look; from 0 it fires at
the floor.
"""

from __future__ import annotations

import math

WATCHED = ("format_violation_rate", "tool_error_rate")
FLOOR = 0.05
_EPS = 1e-9  # float rounding: a rise of 0.01 -> 0.06 is 0.05, not 0.049999...

# (label, metric key, format) in line order
_FIELDS = (("reward", "reward_mean", ".3f"), ("fmt-viol", "format_violation_rate", ".3f"),
           ("tool-err", "tool_error_rate", ".3f"), ("len", "response_len_mean", ".0f"), ("grad", "grad_norm", ".3g"),
           ("clip-hi", "clip_frac_high", ".3f"), ("clip-lo", "clip_frac_low", ".3f"), ("entropy", "entropy", ".3f"))


def _value(metrics: dict, key: str) -> float | None:
    v = metrics.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def health_line(metrics: dict, step: int) -> str:
    """`step 7 | reward 0.312 | fmt-viol 0.310 | tool-err 0.420 | len 812 | grad 0.84 | clip-hi 0.012 | ...`;
    a metric the step does not have prints "-". tool-err is over every tool call of the batch."""
    parts = [f"step {step}"]
    for label, key, fmt in _FIELDS:
        v = _value(metrics, key)
        parts.append(f"{label} {'-' if v is None else format(v, fmt)}")
    return " | ".join(parts)


def collapse_alert(history: list[dict], window: int = 3, factor: float = 2.0,
                   floor: float = FLOOR) -> list[str] | None:
    """Whether the latest step of `history` (per-step metrics, oldest first) shows a collapse: for each of
    format_violation_rate and tool_error_rate, fires when latest ≥ factor · b and latest - b ≥ floor, where b is the
    minimum over the `window` steps before it. Returns what fired, e.g. ["format_violation_rate 0.12 -> 0.31"], or
    None. A step missing the metric, or with no earlier step that has it, never fires for it."""
    if not history:
        return None
    fired = []
    for key in WATCHED:
        now = _value(history[-1], key)
        before = [v for h in history[-1 - window:-1] if (v := _value(h, key)) is not None]
        if now is None or not before:
            continue
        b = min(before)
        if now + _EPS >= factor * b and now - b + _EPS >= floor:
            fired.append(f"{key} {b:.2f} -> {now:.2f}")
    return fired or None


def first_collapse(history: list[dict], **kw) -> tuple[int, list[str]] | None:
    """(index into `history`, what fired) of the first step whose alert fired, each step judged on the history up to
    it; None if none did. `kw`: collapse_alert's window/factor/floor."""
    for i in range(len(history)):
        if fired := collapse_alert(history[:i + 1], **kw):
            return i, fired
    return None
