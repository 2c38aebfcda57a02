"""The chat format read from a model's own template (rstar2.rollout.chat): the tiny world's token stream is unchanged by
it (byte for byte), a Qwen-style template gives Hermes markers and `<|im_end|>` as the turn's stop token, SFT masks
only what the assistant writes, and a template the agent loop cannot use is refused with one clear error."""

import json
import shutil

import pytest

from rstar2.rollout.chat import ChatFormat, ChatTemplateError, prompt_messages, tool_call
from rstar2.rollout.template import TOOL_SCHEMA
from rstar2.training import sft
from rstar2.world.tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS
from tests.fixtures.qwen import make_tokenizer

# what the tiny world's hard-coded format produced before the format moved to its chat template (its learning
# figures depend on these exact streams)
TODAY_PROMPT = (
    '<|im_start|>system\nA conversation between User and Assistant. The User asks a question, and the Ass'
    'istant solves it. The Assistant first thinks about the reasoning process in the mind and then provid'
    'es the User with the answer. The reasoning process is enclosed within <reason> </reason> and answer '
    'is enclosed within <answer> </answer> tags, respectively, i.e., <reason> reasoning process here </re'
    'ason> <answer> answer here </answer>.\n\n# Tools\n\nYou may call one or more functions to assist wit'
    'h the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<to'
    'ols>\n{"type": "function", "function": {"name": "python_code_with_standard_io", "description": "Exec'
    'ute Python code with standard input and capture standard output. If the executed code raises an exce'
    'ption, the error message will be captured and returned instead.", "parameters": {"type": "object", "'
    'properties": {"code": {"type": "string", "description": "Python code to execute; it may read standar'
    'd input with input()."}, "input": {"type": "string", "description": "Text given to the code as stand'
    'ard input."}}, "required": ["code", "input"]}}}\n</tools>\n\nFor each function call, return a json o'
    'bject with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name'
    '": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n<|im_start|>user\nYou '
    'must put your answer inside <answer> </answer> tags, i.e., <answer> answer here </answer>. And your '
    'final answer will be extracted automatically by the \\boxed{} tag.\nThis is the problem:\nWhat is 6 '
    '* 7?<|im_end|>\n<|im_start|>assistant\n<reason>'
)
TODAY_PROMPT_NO_SYSTEM = (
    '<|im_start|>user\nYou must put your answer inside <answer> </answer> tags, i.e., <answer> answer her'
    'e </answer>. And your final answer will be extracted automatically by the \\boxed{} tag.\nThis is th'
    'e problem:\nWhat is 6 * 7?<|im_end|>\n<|im_start|>assistant\n<reason>'
)
TODAY_TOOL_TURN = ('<|im_start|>user\n<tool_response>\nTool call success\nstdout: 42\n\n</tool_response><|im_end|>\n'
                   '<|im_start|>assistant\n<reason>')
TODAY_CALL = ('\nuse python\n</reason>\n<tool_call>\n{"name": "python_code_with_standard_io", "arguments": {"code": '
              '"print(6 * 7)", "input": ""}}\n</tool_call><|im_end|>')

TINY = ChatFormat.from_template(CHAT_TEMPLATE, SPECIAL_TOKENS, "the tiny world's template")


def test_the_tiny_worlds_stream_is_byte_identical_through_its_template():
    assert TINY.prompt("What is 6 * 7?") == TODAY_PROMPT
    assert TINY.prompt("What is 6 * 7?", system=False) == TODAY_PROMPT_NO_SYSTEM
    assert TINY.tool_turn("Tool call success\nstdout: 42\n") == TODAY_TOOL_TURN
    assert TINY.assistant_turn("\nuse python\n</reason>\n", "print(6 * 7)") == TODAY_CALL
    assert (TINY.tool_call_open, TINY.tool_call_close, TINY.end_of_turn) == \
        ("<tool_call>", "</tool_call>", "<|im_end|>")


def test_a_qwen_template_gives_hermes_markers_and_stops_on_im_end(qwen_model_dir):
    chat = ChatFormat.load(qwen_model_dir)
    tok = chat.tokenizer
    assert (chat.tool_call_open, chat.tool_call_close, chat.end_of_turn) == \
        ("<tool_call>", "</tool_call>", "<|im_end|>")
    assert chat.stop_token_ids == [tok.convert_tokens_to_ids("<|im_end|>")] != [tok.eos_token_id]  # eos: <|endoftext|>
    # the prompt is what transformers' apply_chat_template renders with the tool
    assert chat.prompt("What is 6 * 7?") == tok.apply_chat_template(
        prompt_messages("What is 6 * 7?"), tools=[TOOL_SCHEMA], add_generation_prompt=True, tokenize=False)
    assert chat.prompt("x").endswith("<|im_end|>\n<|im_start|>user\nYou must put your answer inside <answer> </answer> "
                                     "tags, i.e., <answer> answer here </answer>. And your final answer will be "
                                     "extracted automatically by the \\boxed{} tag.\nThis is the problem:\nx"
                                     "<|im_end|>\n<|im_start|>assistant\n")
    assert chat.tool_turn("OUT") == ("<|im_start|>user\n<tool_response>\nOUT\n</tool_response><|im_end|>\n"
                                     "<|im_start|>assistant\n")


def test_sft_trains_on_exactly_the_assistants_tokens(qwen_model_dir):
    """A hand-built two-turn transcript with a tool call: the text each assistant message adds after its generation
    header, through <|im_end|>, is trainable (Qwen3-style: an empty <think> block on the turn being written); the
    prompt, the headers and the tool reply are not, and the newline after <|im_end|> is in no stream."""
    chat = ChatFormat.load(qwen_model_dir)
    messages = prompt_messages("What is 6 * 7?") + [
        {"role": "assistant", "content": "Let me compute.", "tool_calls": [tool_call("print(6 * 7)")]},
        {"role": "tool", "content": "Tool call success\nstdout: 42\n"},
        {"role": "assistant", "content": "<answer>\\boxed{42}</answer>"},
    ]
    ids, mask = sft.tokenize(chat, [messages])
    said1 = ('<think>\n\n</think>\n\nLet me compute.\n<tool_call>\n{"name": "python_code_with_standard_io", '
             '"arguments": {"code": "print(6 * 7)", "input": ""}}\n</tool_call><|im_end|>')
    reply = ("<|im_start|>user\n<tool_response>\nTool call success\nstdout: 42\n\n</tool_response><|im_end|>\n"
             "<|im_start|>assistant\n")
    said2 = "<think>\n\n</think>\n\n<answer>\\boxed{42}</answer><|im_end|>"
    parts = [(chat.prompt("What is 6 * 7?"), 0), (said1, 1), (reply, 0), (said2, 1)]
    assert ids[0] == [i for text, _ in parts for i in chat.encode(text)]
    assert mask[0] == [m for text, m in parts for _ in chat.encode(text)]
    tok = chat.tokenizer
    trained = [tok.convert_ids_to_tokens(i) for i, m in zip(ids[0], mask[0]) if m]
    assert trained.count("<|im_end|>") == 2 and trained.count("<tool_call>") == 1
    assert "<|im_start|>" not in trained and "<tool_response>" not in trained


@pytest.fixture(scope="module")
def bare_qwen(tmp_path_factory):
    """Qwen's tokenizer saved once with no chat template; each test copies it and adds its own."""
    d = tmp_path_factory.mktemp("qwen-tokenizer")
    make_tokenizer(None).save_pretrained(str(d))
    return d


@pytest.fixture(scope="module")
def qwen_tokenizer(bare_qwen):
    """Qwen's tokenizer as a model directory gives it (rstar2.rollout.chat.load_tokenizer), loaded once."""
    from rstar2.rollout.chat import load_tokenizer

    return load_tokenizer(bare_qwen)


def _saved(bare, tmp_path, name, template):
    """A model directory of Qwen's tokenizer whose chat template is `template` (None: none), as save_pretrained
    writes it (chat_template.jinja beside the tokenizer)."""
    d = tmp_path / name
    shutil.copytree(bare, d)
    if template is not None:
        (d / "chat_template.jinja").write_text(template)
    return d


NO_TOOLS = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOLS_NO_CALLS = "{% if tools %}{{ tools | tojson }}{% endif %}" + NO_TOOLS
CALLS_NO_REPLY = ("{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}{% if m.role != 'tool' %}"
                  "<|im_start|>{{ m.role }}\n{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>\n"
                  "{{ c.function | tojson }}\n</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
NO_END_OF_TURN = CALLS_NO_REPLY.replace("<|im_end|>", "\n\n")


@pytest.mark.parametrize("template, missing", [
    (None, "has no usable chat template"),
    (NO_TOOLS, "ignores `tools`"),
    (TOOLS_NO_CALLS, "renders no tool call"),
    (CALLS_NO_REPLY, "renders no tool response"),
    (NO_END_OF_TURN, "end-of-turn token"),
], ids=["no template", "no tools", "no tool call", "no tool reply", "no end of turn"])
def test_a_template_the_agent_loop_cannot_use_is_refused_naming_the_model(qwen_tokenizer, template, missing):
    # the tokenizer loaded once (~3 s a load) and each template set on it; the refusal of a model directory read
    # from disk is test_a_run_refuses_such_a_model_before_any_actor_starts
    qwen_tokenizer.chat_template = template
    with pytest.raises(ChatTemplateError, match=missing) as e:
        ChatFormat.of(qwen_tokenizer, "/models/my-model")
    assert str(e.value).startswith("/models/my-model: ")
    assert isinstance(e.value, ValueError) and json.dumps(str(e.value)).count("\\n") == 0  # one line


def test_a_run_refuses_such_a_model_before_any_actor_starts(bare_qwen, tmp_path, monkeypatch):
    from rstar2.core import config
    from rstar2.rollout import cluster
    from rstar2.run.controller import Controller

    monkeypatch.setattr(cluster, "init", lambda: pytest.fail("Ray was started for a model that cannot run"))
    with pytest.raises(ChatTemplateError, match="ignores `tools`"):
        Controller("refused").start(config.load("tiny"), str(_saved(bare_qwen, tmp_path, "plain-chat", NO_TOOLS)))
