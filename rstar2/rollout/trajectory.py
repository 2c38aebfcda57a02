"""A trajectory and its turns (paper §2.1); rstar2.rollout.agent_loop drives them.

Token-in/token-out: each trajectory is the prompt ids plus a response built turn by turn, in the model's chat format
(rstar2.rollout.chat.ChatFormat: prompt, tool-call markers, tool turn). Model tokens get loss mask 1; tool turns (the
tool's reply + the next assistant generation prompt) get loss mask 0. A turn with a tool call runs the first call in the
sandbox (a broken call becomes a parse-error tool response, as in the paper); a turn without one ends the trajectory.
Tool tokens count against the response budget, and a trajectory never ends on a tool turn: if the tool turn would not
fit, or the turn limit is reached, it stops as truncated (reward 0).

When the engine returns the sampled tokens' log-probs (asked for when trainer.old_logprobs=engine or trainer.tis_cap
reads them), they are recorded aligned with the response (`response_logprobs`): tool tokens, which the model did not
sample, get 0.0, and their loss mask 0 keeps them out of the loss.

With a seed, every trajectory-turn samples from a seed of its own (`Trajectory.turn_seed`: the run's seed, problem,
sample and turn), so the rollout is a function of the seed and the weights: the same whatever the policy, the
engine count, the timing or an engine failure (as far as the engine's arithmetic does not depend on the batch).
"""

from __future__ import annotations

import zlib
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

from rstar2.rollout.chat import ChatFormat
from rstar2.rollout.tool_parser import format_tool_response, parse_tool_calls, tool_call_to_request
from rstar2.sandbox import ExecRequest, ExecResult


class Sandbox(Protocol):
    """The tool's sandbox as the agent loop drives it (rstar2.sandbox.backends: every backend)."""

    def submit(self, req: ExecRequest) -> Future:
        """Queue one call; the future resolves to its ExecResult. The sandbox bounds the calls in flight (its workers
        and queue); cancelling a future it has not started drops the call."""


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
    tool_replies: list[str] = field(default_factory=list)  # the text each call got back (with tool_statuses: the
    # k-th call is model turn k's: every turn but the last either called the tool or ended the trajectory)
    assistant_turns: list[str] = field(default_factory=list)
    truncated: bool = False
    done: bool = False
    seed: int | None = None  # its turns' seeds derive from it (turn_seed); None: the engine's own random stream
    response_logprobs: list[float] | None = None  # the engine's, one per response token (0.0 on tool tokens); None:
    # not asked for
    turn_starts: list[int] = field(default_factory=list)  # where each model turn starts in the response
    turn_versions: list[int] = field(default_factory=list)  # the policy version that sampled each model turn
    step_turns: int = 0  # model turns it had when this rollout began (a partial rollout's carried trajectory: > 0)

    @property
    def num_turns(self) -> int:
        return len(self.assistant_turns)

    def turn_seed(self, turn: int | None = None) -> int | None:
        """The next turn's (or model turn `turn`'s) sampling seed: a function of the trajectory and the turn alone,
        so its tokens do not depend on which engine runs it, when, or beside which others (the agent loop's order
        is timing)."""
        k = self.num_turns if turn is None else turn
        return None if self.seed is None else zlib.crc32(f"{self.seed}/{k}".encode())

    def turn_requests(self) -> list[tuple[list[int], int, int | None]]:
        """Its model turns as the agent loop sent them, (context, max_tokens, seed) each. For a replay without tools
        (rstar2.rollout.engine_loop.EngineLoop.submit_chains)."""
        return [(self.prompt_ids + self.response_ids[:i], self.budget - i, self.turn_seed(k))
                for k, i in enumerate(self.turn_starts)]


@dataclass
class Pending:
    traj: Trajectory
    reply: str | None = None  # tool response text, when known without running code
    request: ExecRequest | None = None


def after_turn(traj: Trajectory, text: str, finish: str, limits: RolloutLimits, chat: ChatFormat) -> Pending | None:
    """Decide what follows an assistant turn: nothing (done), or a tool reply (known now or after execution)."""
    if finish == "length" or len(traj.response_ids) >= traj.budget:
        traj.truncated = traj.done = True
        return None
    parsed = parse_tool_calls(text, chat.tool_call_open, chat.tool_call_close)
    if parsed.error is None and not parsed.calls:
        traj.done = True  # a turn without a tool call is the final answer
        return None
    if traj.num_turns >= limits.max_turns:
        traj.truncated = traj.done = True
        return None
    if parsed.error is not None:
        _tool_done(traj, "parse_error", 0.0, parsed.error)
        return Pending(traj, reply=parsed.error)
    req = tool_call_to_request(parsed.calls[0])  # max_parallel_calls = 1, as released
    if isinstance(req, str):
        _tool_done(traj, "error", 0.0, req)
        return Pending(traj, reply=req)
    return Pending(traj, request=req)


def prompt_ids(chat: ChatFormat, questions: list[str]) -> list[list[int]]:
    """The token ids of each problem's prompt, rendered with the model's chat template (one batched tokenizer call)."""
    texts = [chat.prompt(q) for q in questions]
    return chat.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []


def fits(prompt_len: int, limits: RolloutLimits) -> bool:
    """The one rule of room to answer (the rollout's and `rstar2 check`'s): the prompt and the whole response budget
    fit the context (verl's filter_overlong_prompts: prompt + max response <= max_model_len)."""
    return limits.max_model_len is None or prompt_len + limits.max_response_tokens <= limits.max_model_len


def make_trajs(chat: ChatFormat, problems: list[dict], n_samples: int, limits: RolloutLimits,
               seed: int | str | None = None) -> list[Trajectory]:
    """`n_samples` trajectories per problem; with `seed`, trajectory k of a problem samples from a seed of its own
    (derived from seed, problem id and k)."""
    trajs: list[Trajectory] = []
    for p, ids in zip(problems, prompt_ids(chat, [p["prompt"] for p in problems])):
        if not fits(len(ids), limits):
            raise ValueError(f"problem {p['problem_id']}: a prompt of {len(ids)} tokens leaves no room for "
                             f"{limits.max_response_tokens} response tokens in a context of {limits.max_model_len} "
                             "(world.max_positions); `rstar2 check` drops such prompts before a campaign starts")
        trajs += [Trajectory(p["problem_id"], k, str(p["answer"]), ids, limits.max_response_tokens,
                             seed=None if seed is None else zlib.crc32(f"{seed}/{p['problem_id']}/{k}".encode()))
                  for k in range(n_samples)]
    return trajs


def model_turn(t: Trajectory, ids: list[int], finish: str, chat: ChatFormat, limits: RolloutLimits,
               logprobs: list[float] | None = None, version: int = 0) -> Pending | None:
    """Append a model turn (loss mask 1) sampled by policy `version` and, when the engine gave them, its tokens'
    log-probs; what follows it (after_turn)."""
    _record_logprobs(t, ids, logprobs)
    t.turn_starts.append(len(t.response_ids))
    t.turn_versions.append(version)
    t.response_ids += ids
    t.loss_mask += [1] * len(ids)
    text = chat.tokenizer.decode(ids, skip_special_tokens=False)
    t.assistant_turns.append(text)
    return after_turn(t, text, finish, limits, chat)


def _record_logprobs(t: Trajectory, ids: list[int], logprobs: list[float] | None) -> None:
    """A trajectory records log-probs for every model turn or for none (its engines' client asks for all or none)."""
    if logprobs is None and t.response_logprobs is None:
        return
    if logprobs is None or len(logprobs) != len(ids) or (t.response_logprobs is None and t.response_ids):
        raise ValueError(f"trajectory {t.problem_id}/{t.sample_idx}: a turn of {len(ids)} tokens came back with "
                         f"{'no' if logprobs is None else len(logprobs)} log-probs, after "
                         f"{'none' if t.response_logprobs is None else len(t.response_logprobs)} recorded")
    t.response_logprobs = (t.response_logprobs or []) + [float(x) for x in logprobs]


def tool_result(p: Pending, res: ExecResult, limits: RolloutLimits) -> None:
    """The sandbox's answer to p's call becomes its reply text."""
    p.reply = format_tool_response(res, limits.tool_response_chars)
    _tool_done(p.traj, res.status, res.wall_s, p.reply)


def _tool_done(t: Trajectory, status: str, wall_s: float, reply: str) -> None:
    t.tool_statuses.append(status)
    t.tool_wall_s.append(wall_s)
    t.tool_replies.append(reply)


def tool_turn(p: Pending, chat: ChatFormat) -> bool:
    """Append the tool reply (loss mask 0); False (and truncated) if it would not fit: never end on a tool turn."""
    ids = chat.encode(chat.tool_turn(p.reply))
    if len(p.traj.response_ids) + len(ids) >= p.traj.budget:
        p.traj.truncated = p.traj.done = True
        return False
    p.traj.response_ids += ids
    p.traj.loss_mask += [0] * len(ids)
    if p.traj.response_logprobs is not None:
        p.traj.response_logprobs += [0.0] * len(ids)  # not sampled by the model; loss mask 0 keeps them out
    return True


def to_rows(trajs: list[Trajectory], tokenizer) -> list[dict]:
    """Flat records for the rollout Parquet table (one row per trajectory); `response_logprobs` only when the
    engine's were recorded (a trainer that needs them refuses a table without). `policy_version`: the oldest of its
    turns' (a partial rollout's carried trajectory has turns of several)."""
    return [dict(
        problem_id=t.problem_id, sample_idx=t.sample_idx, gold=t.gold, prompt_ids=t.prompt_ids,
        response_ids=t.response_ids, loss_mask=t.loss_mask, tool_statuses=t.tool_statuses,
        tool_wall_s=t.tool_wall_s, num_tool_calls=len(t.tool_statuses), num_turns=t.num_turns,
        truncated=t.truncated, response_len=len(t.response_ids),
        assistant_text="\n".join(t.assistant_turns), final_text=t.assistant_turns[-1] if t.assistant_turns else "",
        response_text=tokenizer.decode(t.response_ids, skip_special_tokens=False),
        turn_versions=t.turn_versions, policy_version=min(t.turn_versions, default=0),
        **({} if t.response_logprobs is None else {"response_logprobs": t.response_logprobs}),
    ) for t in trajs]
