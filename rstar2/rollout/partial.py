"""A partial rollout (rollout.partial; APRIL, arXiv 2509.18521): a step's rollout ends when its quota of groups is
complete, and the trajectories of the other groups carry over to the next step with their turns and the policy
versions that sampled them.

The cut is made on a logical clock, not the wall clock, so that which groups a step trains on, and how far each
carried trajectory got, are a function of the seeds like the rest of a run:

    clock of a trajectory   c_i = model tokens it generated this step (tool tokens not counted)
    a group completes at    c_g = max_i c_i over its trajectories, once all have ended
    the step takes          every group carried in (so no token is more than one step older than the step's
                            policy), then the Q' = Q - carried new groups with the smallest (c_g, g)
    the cut                 T* = c_g of the last new group taken
    the others              each trajectory cut back to its state at T*: its model turns that ended by T*, with
                            their tool replies (a turn that ended later is sampled again next step, from its own
                            seed, on newer weights)

The rollout may stop as soon as that is settled: Q' new groups are complete and every trajectory of an incomplete new
group has ended or passed the current T* (so its state at T* is known; T* only falls as groups complete, and no
incomplete group can then end below it). Until then a trajectory already past the current T* needs no more turns:
the agent loop holds it, which frees its engine for the ones still below.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import polars as pl

from rstar2.rollout.trajectory import Trajectory

INF = (math.inf, math.inf)


def extra_groups(quota: int, extra: float) -> int:
    """Groups in flight beyond the quota (rollout.partial_extra of it, rounded up), fewer than the quota: the step
    always has a new group to take."""
    return min(math.ceil(quota * extra), quota - 1) if quota > 0 else 0


@dataclass
class Cut:
    """The cut of one partial rollout (module docstring). `groups[g]`: trajectory ids of group g, in the rollout's
    order (the carried groups first); `carried`: how many of the first groups were carried in; `quota`: Q, the groups
    the step takes. Feed it each trajectory's clock after each model turn (`progress`) and its end (`ended`)."""
    groups: list[list[int]]
    carried: int
    quota: int

    def __post_init__(self):
        if not 0 <= self.carried < max(self.quota, 1):
            raise ValueError(f"a partial rollout carries {self.carried} groups into a quota of {self.quota}: "
                             "it must carry fewer than its quota")
        self.group_of = {tid: g for g, tids in enumerate(self.groups) for tid in tids}
        self.clock = dict.fromkeys(self.group_of, 0)
        self.ended_ids: set[int] = set()
        self.left = [len(tids) for tids in self.groups]  # trajectories not ended, per group
        self.complete: list[tuple[int, int]] = []  # (c_g, g) of the complete new groups, sorted
        self.new_quota = min(self.quota - self.carried, len(self.groups) - self.carried)
        self.open = {tid for tid, g in self.group_of.items() if g >= self.carried}  # not ended, of a new group, clock
        # at or below T* (or T* unknown): the trajectories that still decide the cut

    # ---- what the agent loop tells it ----------------------------------------------------------------------
    def progress(self, tid: int, clock: int) -> None:
        """tid's clock after a model turn."""
        self.clock[tid] = clock
        if tid in self.open and (clock, self.group_of[tid]) > self.bound:
            self.open.discard(tid)

    def ended(self, tid: int) -> None:
        if tid in self.ended_ids:
            return
        self.ended_ids.add(tid)
        self.open.discard(tid)
        g = self.group_of[tid]
        self.left[g] -= 1
        if not self.left[g] and g >= self.carried:
            before = self.bound
            c_g = max(self.clock[t] for t in self.groups[g])
            self.complete.append((c_g, g))
            self.complete.sort()
            if self.bound < before:  # T* fell: trajectories now past it no longer decide anything
                self.open = {t for t in self.open if (self.clock[t], self.group_of[t]) <= self.bound}

    # ---- what it tells the agent loop ----------------------------------------------------------------------
    @property
    def bound(self) -> tuple[float, float]:
        """(T*, its group) so far: the Q'-th smallest complete new group, or infinity while fewer are complete."""
        if self.new_quota <= 0:
            return (0, -1)
        return self.complete[self.new_quota - 1] if len(self.complete) >= self.new_quota else INF

    def holds(self, tid: int) -> bool:
        """tid's next turn need not run: it is of a new group and past T* (its group cannot be taken, and its
        state at T* is known)."""
        g = self.group_of[tid]
        return g >= self.carried and tid not in self.ended_ids and (self.clock[tid], g) > self.bound

    @property
    def settled(self) -> bool:
        """The cut is final: the carried groups and Q' new ones are complete, and no trajectory still decides it."""
        carried_done = not any(self.left[:self.carried])
        return carried_done and self.bound != INF and not self.open

    def taken(self) -> list[int]:
        """The groups the step takes (once settled): the carried ones, then the new ones in (c_g, g) order."""
        return list(range(self.carried)) + [g for _, g in self.complete[:max(self.new_quota, 0)]]

    @property
    def t_star(self) -> int:
        return int(self.bound[0]) if self.bound != INF else 0


def cut_back(t: Trajectory, t_star: int) -> int:
    """Trajectory t (not taken) as it stood at clock T*: its model turns of this step that ended by T*, with their
    tool replies; a turn that ended later goes, and with it the end of the trajectory. Returns the model tokens cut."""
    clock, keep = 0, t.num_turns
    for k in range(t.step_turns, t.num_turns):
        end = t.turn_starts[k + 1] if k + 1 < t.num_turns else len(t.response_ids)
        clock += sum(t.loss_mask[t.turn_starts[k]:end])
        if clock > t_star:
            keep = k
            break
    if keep == t.num_turns:
        return 0
    at = t.turn_starts[keep]
    cut = sum(t.loss_mask[at:])
    t.response_ids, t.loss_mask = t.response_ids[:at], t.loss_mask[:at]
    if t.response_logprobs is not None:
        t.response_logprobs = t.response_logprobs[:at]
    for name in ("assistant_turns", "tool_statuses", "tool_wall_s", "tool_replies", "turn_versions", "turn_starts"):
        setattr(t, name, getattr(t, name)[:keep])
    t.done = t.truncated = False
    return cut


# ---- the carry: trajectories between two steps ----------------------------------------------------------------
# a carried trajectory's record: its Trajectory fields (all but step_turns) and its problem's prompt text
CARRY_SCHEMA = {"problem_id": pl.String, "sample_idx": pl.Int64, "gold": pl.String, "prompt_ids": pl.List(pl.Int64),
                "budget": pl.Int64, "response_ids": pl.List(pl.Int64), "loss_mask": pl.List(pl.Int64),
                "tool_statuses": pl.List(pl.String), "tool_wall_s": pl.List(pl.Float64),
                "tool_replies": pl.List(pl.String), "assistant_turns": pl.List(pl.String), "truncated": pl.Boolean,
                "done": pl.Boolean, "seed": pl.Int64, "response_logprobs": pl.List(pl.Float64),
                "turn_starts": pl.List(pl.Int64), "turn_versions": pl.List(pl.Int64), "prompt": pl.String}
CARRIED = tuple(k for k in CARRY_SCHEMA if k != "prompt")


def carry_rows(trajs: list[Trajectory], prompts: dict[str, str]) -> list[dict]:
    """The trajectories a step carries over, one record each, with their problem's prompt text (`prompts`: by
    problem id), in the rollout's order."""
    return [{**{k: getattr(t, k) for k in CARRIED}, "prompt": prompts[t.problem_id]} for t in trajs]


def from_carry_rows(rows: list[dict]) -> tuple[list[Trajectory], dict[str, str]]:
    """The carried trajectories (each one's `step_turns` set: its earlier turns are not this step's) and their
    prompts by problem id."""
    trajs = [Trajectory(**{k: r[k] for k in CARRIED}) for r in rows]
    for t in trajs:
        t.step_turns = t.num_turns
    return trajs, {r["problem_id"]: r["prompt"] for r in rows}


@dataclass
class Carry:
    """What one partial rollout hands the next: the trajectories it did not take (cut back to T*), their prompts by
    problem id, and `cursor`: how many problems the stage has drawn from its prompt stream so far."""
    trajs: list[Trajectory]
    prompts: dict[str, str]
    cursor: int

    @property
    def problem_ids(self) -> set[str]:
        return {t.problem_id for t in self.trajs}


@dataclass
class PartialRun:
    """A partial rollout's inputs: `carry` from the step before (its cursor already past this step's new problems),
    the `quota` of groups the step takes, and where its own carry goes (`carry_uri`)."""
    carry: Carry
    quota: int
    carry_uri: str
