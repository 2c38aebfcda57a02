"""Multi-turn agent loop (paper §2.1, implementation notes §4.3, §12.1).

Token-in/token-out: each trajectory is the prompt ids plus a response built turn by turn. Model tokens get loss mask
1; tool turns (`<tool_response>` + the re-opened assistant `<reason>`) get loss mask 0. A turn with a tool call runs
the first call in the sandbox (a broken call becomes a parse-error tool response, as in the paper); a turn without
one ends the trajectory. Tool tokens count against the response budget, and a trajectory never ends on a tool turn:
if the tool turn would not fit, or the turn limit is reached, it stops as truncated (reward 0).

This version advances all live trajectories one turn at a time (a barrier per turn); the KV-aware scheduler issue
replaces that with continuous per-trajectory dispatch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

from rstar2 import template as T
from rstar2.sandbox import ExecRequest, ExecResult
from rstar2.tool_parser import format_tool_response, parse_tool_calls, tool_call_to_request

# generate(prompts, max_tokens) -> [(new_ids, finish_reason)], one assistant turn per prompt
GenerateFn = Callable[[list[list[int]], list[int]], list[tuple[list[int], str]]]


class Sandbox(Protocol):
    def run_batch(self, reqs: list[ExecRequest]) -> list[ExecResult]: ...


@dataclass
class RolloutLimits:
    max_turns: int = 10
    max_response_tokens: int = 8192
    tool_response_chars: int = 256
    max_model_len: int | None = None  # the engine's context: caps prompt + response


@dataclass
class Trajectory:
    problem_id: str
    sample_idx: int
    gold: str
    prompt_ids: list[int]
    budget: int  # response tokens allowed, tool turns included
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    tool_statuses: list[str] = field(default_factory=list)
    tool_wall_s: list[float] = field(default_factory=list)
    assistant_turns: list[str] = field(default_factory=list)
    truncated: bool = False
    done: bool = False

    @property
    def num_turns(self) -> int:
        return len(self.assistant_turns)


@dataclass
class _Pending:
    traj: Trajectory
    reply: str | None = None  # tool response text, when known without running code
    request: ExecRequest | None = None


def _after_turn(traj: Trajectory, text: str, finish: str, limits: RolloutLimits) -> _Pending | None:
    """Decide what follows an assistant turn: nothing (done), or a tool reply (known now or after execution)."""
    if finish == "length" or len(traj.response_ids) >= traj.budget:
        traj.truncated = traj.done = True
        return None
    parsed = parse_tool_calls(text)
    if parsed.error is None and not parsed.calls:
        traj.done = True  # a turn without a tool call is the final answer
        return None
    if traj.num_turns >= limits.max_turns:
        traj.truncated = traj.done = True
        return None
    if parsed.error is not None:
        traj.tool_statuses.append("parse_error")
        traj.tool_wall_s.append(0.0)
        return _Pending(traj, reply=parsed.error)
    req = tool_call_to_request(parsed.calls[0])  # max_parallel_calls = 1, as released
    if isinstance(req, str):
        traj.tool_statuses.append("error")
        traj.tool_wall_s.append(0.0)
        return _Pending(traj, reply=req)
    return _Pending(traj, request=req)


def run(generate: GenerateFn, sandbox: Sandbox, tokenizer, problems: list[dict], n_samples: int,
        limits: RolloutLimits, on_turn: Callable[[int, int], None] | None = None) -> list[Trajectory]:
    """Roll out `n_samples` trajectories per problem (dicts with problem_id, prompt, answer)."""
    trajs: list[Trajectory] = []
    for p in problems:
        prompt_ids = tokenizer(T.build_prompt(p["prompt"]), add_special_tokens=False)["input_ids"]
        budget = limits.max_response_tokens
        if limits.max_model_len:
            budget = min(budget, limits.max_model_len - len(prompt_ids))
        if budget <= 0:
            raise ValueError(f"problem {p['problem_id']}: prompt of {len(prompt_ids)} tokens leaves no room to answer")
        trajs += [Trajectory(p["problem_id"], k, str(p["answer"]), prompt_ids, budget) for k in range(n_samples)]
    turn = 0
    while live := [t for t in trajs if not t.done]:
        budgets = [t.budget - len(t.response_ids) for t in live]
        outs = generate([t.prompt_ids + t.response_ids for t in live], budgets)
        pending: list[_Pending] = []
        for t, (ids, finish) in zip(live, outs):
            t.response_ids += ids
            t.loss_mask += [1] * len(ids)
            text = tokenizer.decode(ids, skip_special_tokens=False)
            t.assistant_turns.append(text)
            if (nxt := _after_turn(t, text, finish, limits)) is not None:
                pending.append(nxt)
        to_run = [p for p in pending if p.request is not None]
        for p, res in zip(to_run, sandbox.run_batch([p.request for p in to_run]) if to_run else []):
            p.traj.tool_statuses.append(res.status)
            p.traj.tool_wall_s.append(res.wall_s)
            p.reply = format_tool_response(res, limits.tool_response_chars)
        for p in pending:
            ids = tokenizer(T.tool_turn(p.reply), add_special_tokens=False)["input_ids"]
            if len(p.traj.response_ids) + len(ids) >= p.traj.budget:
                p.traj.truncated = p.traj.done = True  # never end on a tool turn
                continue
            p.traj.response_ids += ids
            p.traj.loss_mask += [0] * len(ids)
        turn += 1
        if on_turn:
            on_turn(turn, len(live))
    return trajs


def to_rows(trajs: list[Trajectory], tokenizer) -> list[dict]:
    """Flat records for the rollout Parquet table (one row per trajectory)."""
    return [dict(
        problem_id=t.problem_id, sample_idx=t.sample_idx, gold=t.gold, prompt_ids=t.prompt_ids,
        response_ids=t.response_ids, loss_mask=t.loss_mask, tool_statuses=t.tool_statuses,
        tool_wall_s=t.tool_wall_s, num_tool_calls=len(t.tool_statuses), num_turns=t.num_turns,
        truncated=t.truncated, response_len=len(t.response_ids),
        assistant_text="\n".join(t.assistant_turns), final_text=t.assistant_turns[-1] if t.assistant_turns else "",
        response_text=tokenizer.decode(t.response_ids, skip_special_tokens=False),
    ) for t in trajs]
