"""A model's chat format, read from its own chat template: the prompt, the tool turn and the turn's stop token.

Prompts are rendered with the model's template the way transformers' `apply_chat_template(messages, tools=[...],
add_generation_prompt=True)` does (same renderer, same arguments). What the agent loop appends on its own is derived
from the template by rendering a probe conversation (system, user, an assistant turn that calls the tool, the tool's
reply) and taking text deltas:
  - the tool-call markers: the tokenizer's added tokens around the call, which must be Hermes JSON
    `{"name": ..., "arguments": {...}}` (rstar2.rollout.tool_parser reads that): `<tool_call>`/`</tool_call>` for Qwen;
  - the end-of-turn token: the first added token after the call (`<|im_end|>` for Qwen2.5/Qwen3). The engine stops a
    turn on it, not on the tokenizer's eos (a base Qwen's eos is `<|endoftext|>`, which comes after `<|im_end|>`);
  - the tool turn: what the template writes after that assistant turn up to and including the next generation
    prompt, with the tool's reply where the probe's was.

The token stream is what the model generated plus what the loop appends. A model's turn ends on its end-of-turn
token, so what a template writes after that token at the end of every message (Qwen: a newline) is never in the
stream: the tool turn starts at the next message's header. SFT transcripts are rendered the same way (`segments`),
so SFT trains on exactly the streams RL rolls out.

A model whose template cannot do this (none at all, `tools` ignored, no tool call or tool reply rendered, no
end-of-turn token) is refused with one ChatTemplateError naming the model directory and what is missing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rstar2.rollout.template import SYSTEM_PROMPT, TOOL_NAME, TOOL_SCHEMA, USER_PREFIX

# the probe conversation's placeholders, found again in what the template renders
_QUESTION, _CODE, _STDIN, _REPLY = "PROBE_QUESTION_9d1", "print(9)", "PROBE_INPUT_9d1", "PROBE_REPLY_9d1"


class ChatTemplateError(ValueError):
    """A model whose chat template cannot run the agent loop."""


def prompt_messages(question: str, system: bool = True) -> list[dict]:
    """The paper's prompt as chat messages: its system prompt (RL and evaluation always; SFT data may leave it out)
    and the problem after the answer-format instruction."""
    return ([{"role": "system", "content": SYSTEM_PROMPT}] if system else []) + [
        {"role": "user", "content": USER_PREFIX + question}]


def tool_call(code: str, stdin: str = "") -> dict:
    """A call of the Python tool in the common messages layout (an entry of an assistant message's `tool_calls`)."""
    return {"type": "function", "function": {"name": TOOL_NAME, "arguments": {"code": code, "input": stdin}}}


def load_tokenizer(model_dir: str | Path):
    """The model's tokenizer exactly as saved: tokenizer.json as is when there is one (AutoTokenizer would map the
    tiny world's Qwen2 config to Qwen2Tokenizer and swap in Qwen's pre-tokenizer regex; token ids must match what
    SFT and the trainer saw), else whatever AutoTokenizer makes of the directory."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if (Path(model_dir) / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    return AutoTokenizer.from_pretrained(str(model_dir))


@dataclass(frozen=True)
class ChatFormat:
    """A model's chat format (see the module docstring): `load(model_dir)`, or `of(tokenizer, source)`, or
    `from_template` for text alone. Text: `prompt`, `tool_turn`, `segments` (SFT), `assistant_turn`; token ids:
    `encode`, `stop_token_ids`."""

    source: str  # the model directory (or wherever the template came from): named in every error
    template: str
    special: dict  # the tokenizer's special tokens by role (eos_token, ...): apply_chat_template hands them over
    tool_call_open: str
    tool_call_close: str
    end_of_turn: str
    turn_sep: str  # what the template writes after the end-of-turn token at the end of a message (never generated)
    tool_head: str  # the tool turn before the reply ...
    tool_tail: str  # ... and after it, through the next generation prompt
    tokenizer: Any = None  # for token ids; None when only text is needed (the tiny world before its tokenizer)

    # ---- construction -------------------------------------------------------------------------------------
    @classmethod
    def load(cls, model_dir: str | Path) -> "ChatFormat":
        """The chat format of the model in `model_dir` (its tokenizer's template)."""
        return cls.of(load_tokenizer(model_dir), str(model_dir))

    @classmethod
    def of(cls, tokenizer, source: str) -> "ChatFormat":
        try:
            template = tokenizer.get_chat_template(None, tools=[TOOL_SCHEMA])
        except ValueError as e:
            raise ChatTemplateError(f"{source}: the tokenizer has no usable chat template ({e})") from None
        return cls.from_template(template, list(tokenizer.get_added_vocab()), source, tokenizer.special_tokens_map,
                                 tokenizer)

    @classmethod
    def from_template(cls, template: str, added_tokens: list[str], source: str, special: dict | None = None,
                      tokenizer=None) -> "ChatFormat":
        """Probe `template` (see the module docstring); `added_tokens`: the tokenizer's added tokens, where the
        tool-call markers and the end-of-turn token are looked for."""
        special = dict(special or {})

        def render(messages: list[dict], gen: bool, what: str) -> str:
            try:
                return _render(template, special, messages, gen)
            except Exception as e:  # noqa: BLE001 - a template error of any kind is the model's, reported as such
                raise ChatTemplateError(f"{source}: the chat template cannot render {what} ({e})") from None

        def refuse(what: str) -> ChatTemplateError:
            return ChatTemplateError(f"{source}: the chat template {what}")

        user = prompt_messages(_QUESTION)
        call = {"role": "assistant", "content": "", "tool_calls": [tool_call(_CODE, _STDIN)]}
        reply = {"role": "tool", "name": TOOL_NAME, "content": _REPLY}
        prompt = render(user, True, "a prompt")
        if TOOL_NAME not in prompt:
            raise refuse(f"ignores `tools` (the tool {TOOL_NAME!r} is not in the prompt it renders)")
        called = render(user + [call], False, "an assistant message with a tool call")
        if not called.startswith(prompt):
            raise refuse("renders an assistant message that does not start with its generation prompt")
        turn = called[len(prompt):]
        if _CODE not in turn:
            raise refuse("renders no tool call (an assistant message's `tool_calls` are not in what it renders)")
        marks = _added_tokens_in(turn, added_tokens)
        start = turn.find(TOOL_NAME)
        opens = [(p, t) for p, t in marks if p + len(t) <= start]
        closes = [(p, t) for p, t in marks if p >= turn.find(_STDIN) + len(_STDIN)]
        if not opens or len(closes) < 2:
            raise refuse("does not wrap a tool call in added tokens followed by an end-of-turn token "
                         "(Hermes: <tool_call>...</tool_call><|im_end|>)")
        (o, open_), (c, close), (_, eot) = opens[-1], closes[0], closes[1]
        try:
            body = json.loads(turn[o + len(open_):c])
        except ValueError:
            body = None
        if body != {"name": TOOL_NAME, "arguments": tool_call(_CODE, _STDIN)["function"]["arguments"]}:
            raise refuse(f"renders a tool call as {turn[o:c + len(close)]!r}, not Hermes JSON "
                         '{"name": ..., "arguments": {...}} between two tokens')
        sep = turn[turn.rfind(eot) + len(eot):]
        replied = render(user + [call, reply], True, "a tool message")
        n = prompt.count(eot) + 1  # the end-of-turn tokens through the assistant's turn
        try:
            after = after_turns(replied, n, eot, sep)
        except ValueError:
            after = -1
        if after < 0 or replied[after:].count(_REPLY) != 1:
            raise refuse("renders no tool response after an assistant tool call (a `tool` message's content is not "
                         "in what it renders)")
        head, tail = replied[after:].split(_REPLY)
        if not tail.endswith(prompt[len(render(user, False, "a prompt")):]):
            raise refuse("does not end a tool response with the assistant's generation prompt")
        return cls(source, template, special, open_, close, eot, sep, head, tail, tokenizer)

    # ---- text ---------------------------------------------------------------------------------------------
    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """`messages` through the template, with the Python tool (as apply_chat_template(..., tools=[TOOL_SCHEMA]))."""
        return _render(self.template, self.special, messages, add_generation_prompt)

    def prompt(self, question: str, system: bool = True) -> str:
        """The full prompt for a problem, through the next assistant generation prompt."""
        return self.render(prompt_messages(question, system), True)

    def tool_turn(self, reply: str) -> str:
        """What follows an assistant turn that called the tool (loss mask 0): the tool's reply and the next
        generation prompt."""
        return self.tool_head + reply + self.tool_tail

    def segments(self, messages: list[dict]) -> list[tuple[str, bool]]:
        """A transcript as the token stream RL would roll out, in (text, trainable) segments: the text each assistant
        message adds after its generation prompt, through its end-of-turn token, is trainable; the prompt, the
        generation headers and every other message are not. Messages after the last assistant one are left out."""
        segs: list[tuple[str, bool]] = []
        turns = 0  # end-of-turn tokens in the stream so far
        for i, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            head, full = self.render(messages[:i], True), self.render(messages[:i + 1])
            try:
                start = after_turns(head, turns, self.end_of_turn, self.turn_sep) if turns else 0
            except ValueError:
                start = -1
            if start < 0 or not full.startswith(head):
                raise ChatTemplateError(f"{self.source}: the chat template renders message {i} (assistant) so that "
                                        "the conversation before it changes; it cannot be split into turns")
            said = full[len(head):]
            end = said.find(self.end_of_turn)
            if end < 0:
                raise ChatTemplateError(f"{self.source}: message {i} (assistant) renders without the end-of-turn "
                                        f"token {self.end_of_turn!r}")
            said = said[:end + len(self.end_of_turn)]
            segs += [(head[start:], False), (said, True)]
            turns = (head + said).count(self.end_of_turn)
        return [s for s in segs if s[0]]

    def assistant_turn(self, content: str, code: str | None = None, stdin: str = "") -> str:
        """One assistant turn as the model writes it (after the generation prompt, through the end-of-turn token):
        `content`, then a call of the Python tool when `code` is given."""
        msg = {"role": "assistant", "content": content, **({"tool_calls": [tool_call(code, stdin)]} if code else {})}
        return self.segments(prompt_messages("") + [msg])[-1][0]

    # ---- token ids ----------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    @property
    def stop_token_ids(self) -> list[int]:
        """What ends a model's turn in the engine: the template's end-of-turn token."""
        return [self.tokenizer.convert_tokens_to_ids(self.end_of_turn)]


def _render(template: str, special: dict, messages: list[dict], gen: bool) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    out, _ = render_jinja_template([messages], tools=[TOOL_SCHEMA], chat_template=template, add_generation_prompt=gen,
                                   **special)
    return out[0]


def _added_tokens_in(text: str, tokens: list[str]) -> list[tuple[int, str]]:
    """(position, token) of the added tokens in `text`, left to right, as a tokenizer splits them out (the longest
    where two start together; none inside another)."""
    found: dict[int, str] = {}
    for t in tokens:
        i = text.find(t)
        while t and i >= 0:
            if len(t) > len(found.get(i, "")):
                found[i] = t
            i = text.find(t, i + 1)
    out: list[tuple[int, str]] = []
    for i, t in sorted(found.items()):
        if not out or i >= out[-1][0] + len(out[-1][1]):
            out.append((i, t))
    return out


def after_turns(text: str, n: int, eot: str, sep: str) -> int:
    """Where `text` goes on after its n-th end-of-turn token and the separator the template writes after it."""
    pos = 0
    for _ in range(n):
        pos = text.find(eot, pos)
        if pos < 0:
            raise ValueError(f"fewer than {n} end-of-turn tokens")
        pos += len(eot)
    if not text.startswith(sep, pos):
        raise ValueError("no separator after the end-of-turn token")
    return pos + len(sep)
