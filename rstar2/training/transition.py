"""Stage transitions (paper §4.4, Table 3): a stage ends when its curve has plateaued or its step budget is spent;
the next stage then starts with its own length budget, turn limit and data (stage 3: the hard problems the stage-2
policy still fails), resetting the optimizer where the recipe says so.

Plateau test: with a window of w steps, the mean of the last w values gained less than `min_delta` over the mean of
the w values before them, and the stage has run at least `min_steps`. Pure functions; the flows act on the decision.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from rstar2.core.config import PlateauCfg


@dataclass(frozen=True)
class Decision:
    advance: bool  # end this stage now
    reason: str  # "plateau" | "budget" | "continue"
    evidence: dict  # the numbers the decision was taken on (logged to MLflow)

    def to_dict(self) -> dict:
        return asdict(self)


def window_gain(history: list[float], window: int) -> float | None:
    """mean(last w) - mean(the w before); None until 2w values exist."""
    if window < 1 or len(history) < 2 * window:
        return None
    recent, before = history[-window:], history[-2 * window: -window]
    return sum(recent) / window - sum(before) / window


def decide(history: list[float], steps_done: int, max_steps: int, cfg: PlateauCfg | None) -> Decision:
    """Should the stage end after `steps_done` steps, given its metric history (one value per step)?"""
    gain = window_gain(history, cfg.window) if cfg else None
    evidence = {"steps_done": steps_done, "max_steps": max_steps, "metric": cfg.metric if cfg else None,
                "window": cfg.window if cfg else None, "min_delta": cfg.min_delta if cfg else None,
                "window_gain": gain, "last": history[-(cfg.window if cfg else 1):] if history else []}
    if steps_done >= max_steps:
        return Decision(True, "budget", evidence)
    if cfg and steps_done >= cfg.min_steps and gain is not None and gain < cfg.min_delta:
        return Decision(True, "plateau", evidence)
    return Decision(False, "continue", evidence)
