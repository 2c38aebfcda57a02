"""Look at a model (`rstar2 solve`): one trajectory of one problem, through the same agent loop as RL and evaluation
(rstar2.rollout.agent_loop) on one in-process vLLM engine and the configured sandbox, and the same reward check; then
split into its turns: the model's text before its tool call (its reasoning), the call's code and input, the tool's
status and output, and at the end the final answer and, given the gold answer, the reward."""

from __future__ import annotations

from rstar2.core.config import RunCfg
from rstar2.evaluation.export import model_dir as check_model_dir
from rstar2.reward import Verifier, extract_answer
from rstar2.rollout.agent_loop import AgentLoop, EngineSet
from rstar2.rollout.chat import ChatFormat
from rstar2.rollout.engine import EngineSpec, VLLMEngine
from rstar2.rollout.tool_parser import parse_tool_calls, tool_call_to_request
from rstar2.rollout.trajectory import RolloutLimits, Trajectory
from rstar2.run import steps
from rstar2.sandbox import ExecRequest
from rstar2.sandbox.backends import connect


def solve(model: str, problem: str, cfg: RunCfg, answer: str | None = None, temperature: float | None = None,
          max_turns: int | None = None, seed: int = 0) -> dict:
    """The trajectory of `model` (a run's checkpoint or a HF model directory) on `problem` as a record (`turns`), with
    the evaluation's settings of `cfg` (temperature, turns, response length) unless given here."""
    path = str(check_model_dir(model))
    chat = ChatFormat.load(path)  # refuses a model whose template cannot hold a tool conversation
    limits = RolloutLimits(max_turns or cfg.eval.max_turns, cfg.eval.max_response_tokens,
                           cfg.rollout.tool_response_chars, cfg.world.max_positions)
    t = cfg.eval.temperature if temperature is None else temperature
    sandbox = connect(cfg.sandbox)  # the tool's and the reward check's
    engine = VLLMEngine(EngineSpec.of_run(cfg, path, seed))  # the run's engine, as the run's config starts it
    try:
        client = engine.client(t, cfg.rollout.top_p)
        tool = sandbox if cfg.rollout.tool_enabled else steps.ToolDisabled()
        loop = AgentLoop(EngineSet([client], [client.capacity]), cfg.scheduler, tool, chat, limits)
        (traj,), _ = loop.run([{"problem_id": "solve", "prompt": problem, "answer": answer or ""}], 1, seed)
        final = traj.assistant_turns[-1]
        reward = None
        if answer is not None:
            reward = Verifier(sandbox, timeout_s=cfg.sandbox.verify_timeout_s).score([final], [answer],
                                                                                   [traj.truncated])[0]
    finally:
        engine.close()
        sandbox.close()
    return {"model": path, "problem": problem, "gold": answer, "temperature": t, "seed": seed,
            "turns": turns(traj, chat), "final_answer": extract_answer(final), "reward": reward,
            "truncated": traj.truncated, "response_tokens": len(traj.response_ids)}


def turns(traj: Trajectory, chat: ChatFormat) -> list[dict]:
    """Each model turn: its text, the text before its tool call (its reasoning), and its call if it made one: code
    and input (None for a call that could not be decoded), the tool's status and the text it sent back."""
    out = []
    for k, text in enumerate(traj.assistant_turns):
        parsed = parse_tool_calls(text, chat.tool_call_open, chat.tool_call_close)
        call = tool_call_to_request(parsed.calls[0]) if parsed.calls else None
        turn = {"text": text, "reasoning": text.split(chat.tool_call_open)[0], "tool": None}
        if k < len(traj.tool_statuses):
            turn["tool"] = {"code": call.code if isinstance(call, ExecRequest) else None,
                            "input": call.stdin if isinstance(call, ExecRequest) else None,
                            "status": traj.tool_statuses[k], "output": traj.tool_replies[k]}
        out.append(turn)
    return out
