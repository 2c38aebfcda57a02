"""`rstar2 solve`'s view of a trajectory (rstar2.run.solve.turns, rstar2.cli.tables.trajectory_view): each model
turn split into its reasoning and its tool call (code, input, status, the text the tool sent back), then the final
answer and the reward. The real engine run of the command: tests/engine/test_look.py."""

from rich.console import Console

from rstar2.cli.tables import trajectory_view
from rstar2.rollout import template as T
from rstar2.rollout.chat import ChatFormat
from rstar2.rollout.trajectory import Trajectory
from rstar2.run.solve import turns
from rstar2.world import tokenizer as tiny

CHAT = ChatFormat.from_template(tiny.CHAT_TEMPLATE, tiny.SPECIAL_TOKENS, "the tiny world's template")
CALL = "\nmultiply\n" + T.REASON_CLOSE + "\n" + CHAT.assistant_turn("", "print(int(input()) * 7)", "6")
BROKEN = "\nagain\n" + T.REASON_CLOSE + "\n<tool_call>\n{\"name\": oops}\n</tool_call>" + tiny.IM_END
ANSWER = "\nso 42\n" + T.REASON_CLOSE + "\n" + T.ANSWER_OPEN + "\\boxed{42}" + T.ANSWER_CLOSE + tiny.IM_END


def test_turns_pair_each_call_with_its_status_and_reply_and_the_view_shows_every_section():
    t = Trajectory("p", 0, "42", [1], 100, assistant_turns=[CALL, BROKEN, ANSWER], tool_statuses=["ok", "parse_error"],
                   tool_replies=["Tool call success\nstdout: 42\n", "Failed to decode tool call: Expecting value"])
    got = turns(t, CHAT)
    reasoning = [g["reasoning"] for g in got]
    assert reasoning == ["\nmultiply\n" + T.REASON_CLOSE + "\n", "\nagain\n" + T.REASON_CLOSE + "\n", ANSWER]
    assert got[0]["tool"] == {"code": "print(int(input()) * 7)", "input": "6", "status": "ok",
                              "output": "Tool call success\nstdout: 42\n"}
    assert got[1]["tool"]["code"] is None and got[1]["tool"]["status"] == "parse_error" and got[2]["tool"] is None

    rec = {"problem": "Compute [6] * 7.", "turns": got, "final_answer": "42", "truncated": False, "reward": 1.0,
           "gold": "42"}
    console = Console(record=True, width=100)
    for part in trajectory_view(rec):
        console.print(part)
    text = console.export_text()
    order = ["Compute [6] * 7.", "turn 1: reasoning", "multiply", "turn 1: code (input '6')", "print(int(input()) * 7)",
             "turn 1: tool output [ok]", "stdout: 42", "turn 2: reasoning", "turn 2: tool output [parse_error]",
             "Failed to decode", "turn 3: reasoning", "final answer: 42", "reward: 1 (gold 42)"]
    at = [text.find(s) for s in order]
    assert -1 not in at and at == sorted(at), dict(zip(order, at))
    assert "turn 2: code" not in text and "turn 3: tool" not in text
