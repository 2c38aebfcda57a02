"""Training health: one line per RL step for the run's log (terminal and Prefect UI), and the collapse alert.

An agentic-RL run that collapses shows it first in how the policy uses its environment, before the reward falls:
more malformed answers and more failing tool calls (format violations 0.20 -> 0.63 and tool errors 0.25 -> 0.58 in
the weak-start runs of docs/findings.md). The alert watches those two rates, each against where the run started and
against the run's own noise. Healthy tiny campaigns move a rate by 0.10-0.15 for a step or even four (format
violations 0.04 -> 0.20 -> 0.07 in a run that gained +0.285) and still end far below where they started; a collapse
takes the policy past the SFT model it started from and keeps it there. For a rate x_1..x_t, with the last
`persist` steps R = x_{t-p+1..t} and the steps before them P = x_1..x_{t-p} (at least `min_history` of them):

    sigma = max(noise_floor, 1.4826 * median_i |x_i - x_{i-1}| / sqrt(2))   over P   (robust step-to-step sd)
    s     = (x_1 + x_2) / 2                                                            (where the run started)
    fire  ⇔  min(R) ≥ s + z * sigma

i.e. each of the last 2 steps is 2 noise-sds above the run's starting level. The median of step differences is the
noise of the run itself, not of its trend or its blips; the noise floor (0.02, about the binomial standard error of a
rate of 0.1 over 256 trajectories) keeps a run that happened to be smooth from firing on small moves. On the recorded
runs (tests/data/health/) no healthy run ever had two steps in a row above its starting level (the highest, in noise
sds: -0.26), and the weak-start collapses reached 4.3 and 5.1 sds, firing 1 step after their start.
"""

from __future__ import annotations

import math
import statistics

WATCHED = ("format_violation_rate", "tool_error_rate")
PERSIST = 2  # steps the rise must hold
MIN_HISTORY = 3  # steps before them to measure the starting level and the noise from
Z = 2.0  # noise sds above the starting level
NOISE_FLOOR = 0.02
_EPS = 1e-9  # float rounding: 0.10 + 3 x 0.02 is 0.16, not 0.16000000000000003

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


def collapse_alert(history: list[dict], persist: int = PERSIST, min_history: int = MIN_HISTORY, z: float = Z,
                   noise_floor: float = NOISE_FLOOR) -> list[str] | None:
    """Whether the latest step of `history` (per-step metrics, oldest first) shows format_violation_rate or
    tool_error_rate risen above the run's starting level by z noise-sds for the last `persist` steps (the module's
    rule). Returns what fired, e.g. ["tool_error_rate 0.14 -> 0.40 (noise 0.02)"] (starting level -> latest), or
    None. Steps missing a metric are left out of its series; a series too short for the rule never fires."""
    fired = []
    for key in WATCHED:
        x = [v for h in history if (v := _value(h, key)) is not None]
        past, recent = x[:-persist], x[-persist:]
        if len(past) < max(min_history, 3) or len(recent) < persist:
            continue
        sigma = max(noise_floor, 1.4826 * statistics.median(abs(b - a) for a, b in zip(past, past[1:])) / math.sqrt(2))
        start = (x[0] + x[1]) / 2
        if min(recent) + _EPS >= start + z * sigma:
            fired.append(f"{key} {start:.2f} -> {recent[-1]:.2f} (noise {sigma:.2f})")
    return fired or None


def first_collapse(history: list[dict], **kw) -> tuple[int, list[str]] | None:
    """(index into `history`, what fired) of the first step whose alert fired, each step judged on the history up to
    it; None if none did. `kw`: collapse_alert's parameters."""
    for i in range(len(history)):
        if fired := collapse_alert(history[:i + 1], **kw):
            return i, fired
    return None
