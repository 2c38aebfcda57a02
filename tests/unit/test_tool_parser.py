"""Tool-call parsing of one assistant turn and the tool-response text. The markers are
Hermes' (what rstar2.rollout.chat reads off a Qwen-style template); another pair works the same."""

import functools
import json

from rstar2.rollout.template import TOOL_NAME
from rstar2.rollout.tool_parser import ToolCall, format_tool_response, tool_call_to_request, truncate_middle
from rstar2.rollout.tool_parser import parse_tool_calls as parse_with
from rstar2.sandbox import ExecRequest, ExecResult

parse_tool_calls = functools.partial(parse_with, open_="<tool_call>", close="</tool_call>")


def tool_call_text(code: str, stdin: str = "") -> str:
    """A Hermes tool call as a Qwen-style template renders it."""
    call = json.dumps({"name": TOOL_NAME, "arguments": {"code": code, "input": stdin}})
    return "<tool_call>\n" + call + "\n</tool_call>"


def test_no_tool_call():
    assert parse_tool_calls("just thinking </reason> <answer>\\boxed{1}</answer>").calls == []
    assert parse_tool_calls("just thinking").error is None


def test_good_call_from_template():
    turn = "Let me compute.\n" + tool_call_text("print(input())", "7") + "<|im_end|>"
    parsed = parse_tool_calls(turn)
    assert parsed.error is None
    assert parsed.calls == [ToolCall(TOOL_NAME, {"code": "print(input())", "input": "7"})]
    assert tool_call_to_request(parsed.calls[0]) == ExecRequest(code="print(input())", stdin="7")


def test_two_calls_in_order():
    parsed = parse_tool_calls(tool_call_text("1") + " then " + tool_call_text("2"))
    assert parsed.error is None and [c.arguments["code"] for c in parsed.calls] == ["1", "2"]


def test_broken_json_keeps_earlier_calls():
    turn = tool_call_text("1") + '<tool_call>\n{"name": "x", arguments: {}}\n</tool_call>'
    parsed = parse_tool_calls(turn)
    assert parsed.error.startswith("Failed to decode tool call: Expecting property name")
    assert [c.arguments["code"] for c in parsed.calls] == ["1"]


def test_missing_closing_tag():
    parsed = parse_tool_calls('<tool_call>\n{"name": "%s", "arguments": {"code": "1"}}' % TOOL_NAME)
    assert parsed.calls == [] and parsed.error.startswith("Failed to decode tool call:")
    assert "</tool_call>" in parsed.error


def test_missing_keys_and_wrong_types():
    for body, needle in [('{"name": "%s"}' % TOOL_NAME, "'arguments'"), ('{"arguments": {}}', "'name'"),
                         ('[1, 2]', "JSON object"), ('{"name": 3, "arguments": {}}', "'name' must be"),
                         ('{"name": "f", "arguments": [1]}', "'arguments' must be")]:
        parsed = parse_tool_calls(f"<tool_call>{body}</tool_call>")
        assert parsed.calls == [] and parsed.error.startswith("Failed to decode tool call:") and needle in parsed.error
    assert parse_tool_calls("<tool_call>" + "[" * 100_000 + "</tool_call>").error.startswith("Failed to decode")


def test_markers_are_the_callers():
    text = '[CALL]{"name": "%s", "arguments": {"code": "1"}}[/CALL]' % TOOL_NAME
    assert parse_with(text, "[CALL]", "[/CALL]").calls == [ToolCall(TOOL_NAME, {"code": "1"})]
    hermes = parse_tool_calls(text)
    assert hermes.calls == [] and hermes.error is None  # no Hermes marker in it: no call


def test_arguments_as_json_string():
    args = json.dumps({"code": "print(2)", "input": ""})
    parsed = parse_tool_calls("<tool_call>" + json.dumps({"name": TOOL_NAME, "arguments": args}) + "</tool_call>")
    assert parsed.error is None and parsed.calls[0].arguments == {"code": "print(2)", "input": ""}


def test_unknown_tool_and_bad_arguments():
    assert tool_call_to_request(ToolCall("WolframAlpha", {"code": "1"})).startswith(
        "Error when executing tool: unknown tool 'WolframAlpha'")
    assert tool_call_to_request(ToolCall(TOOL_NAME, {"input": "1"})).startswith("Error when executing tool:")
    assert tool_call_to_request(ToolCall(TOOL_NAME, {"code": "1", "input": 5})).startswith("Error when executing")
    assert tool_call_to_request(ToolCall(TOOL_NAME, {"code": "1"})) == ExecRequest("1", "")  # input optional


def test_format_tool_response():
    ok = ExecResult("ok", "42\n", "warning", 0, 0.1, 0.1)
    assert format_tool_response(ok) == "Tool call success\nstdout: 42\n"
    bad = ExecResult("error", "", "Traceback...\nValueError: x\n", 1, 0.1, 0.1)
    expected = "Tool call failure\nreason: error\nstdout: \nstderr: Traceback...\nValueError: x\n"
    assert format_tool_response(bad) == expected
    assert "0.1" not in format_tool_response(ExecResult("timeout", "", "", None, 4.0, 4.0))


def test_object_addresses_read_the_same_from_every_executor():
    gen = "<generator object <genexpr> at 0x7fd766735560>\n<function f at 0x7f0e4b35560>\n"
    other = "<generator object <genexpr> at 0x7fd0e4b35560>\n<function f at 0x7f3a00000010>\n"
    assert format_tool_response(ExecResult("ok", gen, "", 0, 0.1, 0.1)) == \
        format_tool_response(ExecResult("ok", other, "", 0, 0.1, 0.1)) == \
        "Tool call success\nstdout: <generator object <genexpr> at 0x7f0000000000>\n<function f at 0x7f0000000000>\n"
    plain = "0x7fd766735560 at 0x1f> hex(255) = 0xff\n"  # not an object's repr: unchanged
    assert format_tool_response(ExecResult("ok", plain, "", 0, 0.1, 0.1)) == f"Tool call success\nstdout: {plain}"


def test_truncation_keeps_head_and_tail_within_budget():
    long = ExecResult("ok", "A" + "x" * 5000 + "Z", "", 0, 0.1, 0.1)
    text = format_tool_response(long, max_chars=256)
    assert len(text) == 256 and "...(truncated)..." in text
    assert text.startswith("Tool call success\nstdout: Ax") and text.endswith("xZ")
    assert truncate_middle("short", 256) == "short"
