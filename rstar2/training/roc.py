"""GRPO-RoC: Resample-on-Correct down-sampling (rStar2-Agent, arXiv 2508.20722, §2.2.3, Eq. 4-5).

Per prompt we roll out 2G trajectories and keep G of them (paper: 32 -> 16):

    O_neg (reward <= 0): keep floor(|O_neg| / 2), uniformly at random                   ("no filtering")
    O_pos (reward >  0): fill the rest, sampled w/o replacement with P ∝ 1 / p_total
    p_total = p_err + p_format
    p_err    = #erroneous tool calls / #tool calls, or 0.5 with no tool call             (Eq. 4)
    p_format = 1 if there is no <answer>, else min(1, (#answers - 1) / #turns)          (Eq. 5)

Deliberate departures from the released code (microsoft/rStar, built on verl):
  - p_err reads structured tool statuses, so timeouts and parse failures count as errors (the release
    greps for "error" in the tool text and misses both).
  - p_format counts every assistant turn, the first one included (the release never sees the first turn,
    so a clean tool-free answer gets 1.0 instead of 0.0).
  - mode="paper" samples positives ∝ 1/(p_total + eps); mode="release" takes the lowest penalties (stable).
  - Quota: k_neg = round-half-down(|O_neg| * G / n), k_pos = G - k_neg (see `quotas`). For n = 2G this is
    exactly the paper's floor(|O_neg|/2); the release rounds half-to-even instead (7 of 16 -> 4, ours 3).
  - A group smaller than G is kept whole (the release drops it). Negatives are random in both modes (the
    release takes the first k in rollout order, which is the same distribution for i.i.d. rollouts).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from rstar2.rollout.template import ANSWER_CLOSE, ANSWER_OPEN
from rstar2.sandbox.api import OK, OUTPUT_TRUNCATED

# "output_truncated" is a run that succeeded but printed too much: the model did nothing wrong, so it is not
# an error. Every other status ("error", "timeout", "parse_error", "memory", "killed", or anything unknown)
# is a failed tool call: the paper's p_err covers execution errors, timeouts and format/parse failures.
OK_STATUSES = frozenset({OK, OUTPUT_TRUNCATED})
_ANSWER_PAIR = re.compile(re.escape(ANSWER_OPEN) + r".*?" + re.escape(ANSWER_CLOSE), re.DOTALL)


def p_err(tool_statuses: Sequence[str]) -> float:
    """Eq. 4: fraction of failed tool calls; 0.5 for a trajectory that never called the tool."""
    if len(tool_statuses) == 0:
        return 0.5
    return sum(s not in OK_STATUSES for s in tool_statuses) / len(tool_statuses)


def count_answer_blocks(text: str) -> tuple[int, bool]:
    """(# closed <answer>...</answer> pairs, True if any tag is left over, e.g. an unclosed <answer>)."""
    n_pairs = len(_ANSWER_PAIR.findall(text))
    unbalanced = text.count(ANSWER_OPEN) != n_pairs or text.count(ANSWER_CLOSE) != n_pairs
    return n_pairs, unbalanced


def p_format(num_answer_blocks: int, has_unclosed_answer: bool, num_assistant_turns: int) -> float:
    """Eq. 5: 1 without a (well-formed) answer, else min(1, (#answers - 1) / #turns), first turn included."""
    if num_answer_blocks <= 0 or has_unclosed_answer:
        return 1.0
    turns = max(num_assistant_turns, 1)  # an answer implies at least one assistant turn
    return min(1.0, (num_answer_blocks - 1) / turns)


def is_all_equal(rewards) -> bool:
    """True when the group carries no learning signal (all advantages would be 0). Empty counts as equal."""
    r = np.asarray(rewards, dtype=np.float64)
    return r.size == 0 or bool(np.allclose(r, r[0]))


def quotas(n_neg: int, n_pos: int, keep: int, min_pos: int = 2, min_neg: int = 2) -> tuple[int, int]:
    """(k_neg, k_pos) with k_neg + k_pos = keep, for a group of n = n_neg + n_pos >= keep rollouts.

    k_neg = round-half-down(n_neg * keep / n) = ceil(n_neg * keep / n - 1/2), in exact integer arithmetic.
    For n = 2 * keep, n_neg * keep / n = n_neg / 2 is a whole or half number, so k_neg = floor(n_neg / 2)
    (paper). Positives get the remainder, k_pos = round-half-up(n_pos * keep / n) <= n_pos, so neither quota
    ever exceeds what the group has. Then the minimum guards (release: 2 and 2): a side whose quota is below
    min(min_x, n_x) is raised to it and the other side lowered; if both guards cannot hold at once
    (keep < need_pos + need_neg, only for tiny keep) the proportional split stands.
    """
    n = n_neg + n_pos
    k_neg = (2 * n_neg * keep + n - 1) // (2 * n)
    k_pos = keep - k_neg
    need_pos, need_neg = min(min_pos, n_pos), min(min_neg, n_neg)
    if need_pos + need_neg <= keep:
        if k_pos < need_pos:
            k_pos, k_neg = need_pos, keep - need_pos
        elif k_neg < need_neg:
            k_neg, k_pos = need_neg, keep - need_neg
    return k_neg, k_pos


def select_group(rewards, penalties, keep: int, rng: np.random.Generator, mode: str = "paper",
                 min_pos: int = 2, min_neg: int = 2, eps: float = 1e-6) -> np.ndarray:
    """Indices (sorted, into this group) of the `keep` rollouts RoC trains on. penalties = p_total, finite >= 0."""
    r = np.asarray(rewards, dtype=np.float64)            # (n,)
    pen = np.asarray(penalties, dtype=np.float64)        # (n,)
    if mode not in ("paper", "release"):
        raise ValueError(f"mode must be 'paper' or 'release', got {mode!r}")
    if r.size <= keep:  # nothing to down-sample: a short group still has signal, keep it whole
        return np.arange(r.size)
    neg, pos = np.flatnonzero(r <= 0), np.flatnonzero(r > 0)
    k_neg, k_pos = quotas(len(neg), len(pos), keep, min_pos, min_neg)
    # Negatives: "no filtering", a uniform sample keeps the distribution of failure modes intact.
    kept_neg = rng.choice(neg, size=k_neg, replace=False)
    if k_pos == 0:  # e.g. an all-negative group: skip, there may be no weights to normalise
        kept_pos = pos[:0]
    elif mode == "paper":
        # Successive weighted draws w/o replacement (numpy rejects repeats, renormalising the rest).
        w = 1.0 / (pen[pos] + eps)                        # (n_pos,) a clean trajectory weighs ~1/eps
        kept_pos = rng.choice(pos, size=k_pos, replace=False, p=w / w.sum())
    else:
        # Release: deterministic top-k by penalty; stable sort keeps rollout order on ties.
        kept_pos = pos[np.argsort(pen[pos], kind="stable")[:k_pos]]
    return np.sort(np.concatenate([kept_neg, kept_pos]).astype(np.int64))


@dataclass(frozen=True)
class RocResult:
    mask: np.ndarray        # (N,) bool: rollout is trained on
    kept: int               # mask.sum()
    dropped_groups: int     # groups removed by the all-equal-reward rule
    dropped_rollouts: int   # rollouts in those groups (the rest of ~mask is RoC down-sampling)


def roc_select(group_ids, rewards, penalties, keep: int | None, rng: np.random.Generator, mode: str = "paper",
               drop_all_equal: bool = True, min_pos: int = 2, min_neg: int = 2) -> RocResult:
    """RoC over a flat batch: group_ids (N,) name each rollout's prompt. Groups are visited in sorted id
    order, so the result is a pure function of the inputs and the rng state. Dropped groups are not refilled
    (the batch just shrinks, as in the release). keep=None: no down-sampling (plain GRPO), every group is kept
    whole and only the all-equal rule applies."""
    gid = np.asarray(group_ids)
    r = np.asarray(rewards, dtype=np.float64)            # (N,)
    pen = np.asarray(penalties, dtype=np.float64)        # (N,)
    mask = np.zeros(r.size, dtype=bool)                  # (N,)
    _, inv, counts = np.unique(gid, return_inverse=True, return_counts=True)
    members = np.split(np.argsort(inv.ravel(), kind="stable"), np.cumsum(counts)[:-1]) if r.size else []
    dropped_groups = dropped_rollouts = 0
    for idx in members:                                  # idx: (n_g,) batch positions of one prompt
        if drop_all_equal and is_all_equal(r[idx]):
            dropped_groups, dropped_rollouts = dropped_groups + 1, dropped_rollouts + idx.size
            continue
        mask[idx if keep is None else idx[select_group(r[idx], pen[idx], keep, rng, mode, min_pos, min_neg)]] = True
    return RocResult(mask, int(mask.sum()), dropped_groups, dropped_rollouts)
