"""The ablations (paper §5.3-5.4, Fig. 4/8): each is a name for a set of config overrides on top of a preset. They
share the preset's world and SFT model, so the only difference between their runs is the RL recipe."""

from __future__ import annotations

VARIANTS: dict[str, list[str]] = {
    "roc": [],  # GRPO-RoC, the paper's recipe (the preset as is)
    "plain-grpo": ["roc.enabled=false"],  # G rollouts per prompt, no oversampling, no RoC filtering
    "overlong-filter": ["trainer.overlong_filter=true"],  # truncated rollouts masked out of the loss (DAPO)
    "no-tool": ["rollout.tool_enabled=false"],  # tool calls answered "tool disabled": RL without the tool
    # the overlapping step: each next rollout beside the update, one version behind, corrected by truncated IS
    "overlap": ["rollout.max_staleness=1", "trainer.tis_cap=2.0"],
    # the cut long tail: a step's rollout ends at its quota of groups, the rest carries over (rstar2.rollout.partial)
    "partial": ["rollout.partial=true", "trainer.tis_cap=2.0"],
    # both: partial rollouts that overlap the update
    "overlap-partial": ["rollout.max_staleness=1", "rollout.partial=true", "trainer.tis_cap=2.0"],
}


def overrides(variant: str) -> list[str]:
    if variant not in VARIANTS:
        raise ValueError(f"unknown ablation variant {variant!r}; available: {', '.join(VARIANTS)}")
    return [*VARIANTS[variant], f"ablation={variant}"]
