"""The rStar2-Agent chat format (released template, implementation notes §4.1).

A trajectory is one token stream:

    <|im_start|>system ...tools...<|im_end|>
    <|im_start|>user ...problem...<|im_end|>
    <|im_start|>assistant
    <reason>            <- pre-filled by the prompt: the model continues inside a reasoning block
    ... <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>        (assistant turn, loss mask 1)
    <|im_start|>user
    <tool_response>
    ...
    </tool_response><|im_end|>
    <|im_start|>assistant
    <reason>            <- tool turns (loss mask 0) end by re-opening the assistant's reasoning
    ... </reason>
    <answer> ... \\boxed{42} ... </answer><|im_end|>
"""

from __future__ import annotations

import json

IM_START, IM_END, PAD, EOT = "<|im_start|>", "<|im_end|>", "<|pad|>", "<|endoftext|>"
REASON_OPEN, REASON_CLOSE = "<reason>", "</reason>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
SPECIAL_TOKENS = [
    EOT, IM_START, IM_END, PAD,
    REASON_OPEN, REASON_CLOSE, ANSWER_OPEN, ANSWER_CLOSE,
    TOOL_CALL_OPEN, TOOL_CALL_CLOSE, TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE,
]

TOOL_NAME = "python_code_with_standard_io"
TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": (
            "Execute Python code with standard input and capture standard output. "
            "If the executed code raises an exception, the error message will be captured and returned instead."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "description": "Python code to execute; it may read standard input with input()."},
                "input": {"type": "string", "description": "Text given to the code as standard input."},
            },
            "required": ["code", "input"],
        },
    },
}

SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The User asks a question, and the Assistant solves it. "
    "The Assistant first thinks about the reasoning process in the mind and then provides the User with the answer. "
    "The reasoning process is enclosed within <reason> </reason> and answer is enclosed within <answer> </answer> "
    "tags, respectively, i.e., <reason> reasoning process here </reason> <answer> answer here </answer>.\n\n"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(TOOL_SCHEMA)
    + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)

USER_PREFIX = (
    "You must put your answer inside <answer> </answer> tags, i.e., <answer> answer here </answer>. "
    "And your final answer will be extracted automatically by the \\boxed{} tag.\nThis is the problem:\n"
)

# Jinja chat template saved with the tokenizer, so vLLM / transformers render the same prompt as build_prompt().
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}<|im_start|>system\n{{ m['content'] }}<|im_end|>\n"
    "{% elif m['role'] == 'user' %}<|im_start|>user\n" + USER_PREFIX.replace("\\", "\\\\").replace("\n", "\\n")
    + "{{ m['content'] }}<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>assistant\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<reason>{% endif %}"
)


def build_prompt(question: str, system: bool = True) -> str:
    """The full prompt text for a problem, ending with the pre-filled `<reason>`. RL and evaluation always use the
    system prompt; SFT data may leave it out (general instruction data has none, paper §4.1)."""
    return (
        (f"{IM_START}system\n{SYSTEM_PROMPT}{IM_END}\n" if system else "")
        + f"{IM_START}user\n{USER_PREFIX}{question}{IM_END}\n"
        f"{IM_START}assistant\n{REASON_OPEN}"
    )


def tool_turn(response_text: str) -> str:
    """Text appended after an assistant turn that called the tool (loss mask 0): the tool's reply, then a new
    assistant turn re-opened inside `<reason>`. No newline before it: the model's turn ends on `<|im_end|>`."""
    return (
        f"{IM_START}user\n{TOOL_RESPONSE_OPEN}\n{response_text}\n{TOOL_RESPONSE_CLOSE}{IM_END}\n"
        f"{IM_START}assistant\n{REASON_OPEN}"
    )


def tool_call_text(code: str, stdin: str = "") -> str:
    """A well-formed Hermes-style tool call, as the SFT data teaches it."""
    payload = {"name": TOOL_NAME, "arguments": {"code": code, "input": stdin}}
    return f"{TOOL_CALL_OPEN}\n{json.dumps(payload)}\n{TOOL_CALL_CLOSE}"
