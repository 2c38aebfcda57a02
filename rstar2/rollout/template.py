"""The rStar2-Agent prompt protocol (the released code's template): the system prompt, the
answer-format instruction before each problem, the reasoning and answer tags, and the Python tool's schema.

How these travel in the token stream (turn markers, the tools block, tool-call syntax, the tool's reply, the turn's stop
token) is the model's chat template's business: rstar2.rollout.chat renders them with it. With a Qwen-style template
(and the tiny world's, rstar2.world.tokenizer) a trajectory reads:

    <|im_start|>system ...SYSTEM_PROMPT... # Tools ...TOOL_SCHEMA...<|im_end|>
    <|im_start|>user USER_PREFIX ...problem...<|im_end|>
    <|im_start|>assistant
    <reason> ... </reason>  <tool_call>{"name": ..., "arguments": {...}}</tool_call><|im_end|>   (loss mask 1)
    <|im_start|>user
    <tool_response> ... </tool_response><|im_end|>                                             (loss mask 0)
    <|im_start|>assistant
    <reason> ... </reason>
    <answer> ... \\boxed{42} ... </answer><|im_end|>
"""

from __future__ import annotations

REASON_OPEN, REASON_CLOSE = "<reason>", "</reason>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"

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
                "code": {"type": "string",
                         "description": "Python code to execute; it may read standard input with input()."},
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
    "tags, respectively, i.e., <reason> reasoning process here </reason> <answer> answer here </answer>."
)

USER_PREFIX = (
    "You must put your answer inside <answer> </answer> tags, i.e., <answer> answer here </answer>. "
    "And your final answer will be extracted automatically by the \\boxed{} tag.\nThis is the problem:\n"
)
