"""A tool-aware chat template for a model whose own has no tool support, and the marker tokens it needs.

Many instruct models (SmolLM2, older Llama and Mistral fine-tunes) ship a chat template that ignores `tools` and a
tokenizer without tool-call tokens; the agent loop (rstar2.rollout.chat) needs both. `add` gives such a model, of a
ChatML family (`<|im_start|>` / `<|im_end|>` turns), the Hermes-style format Qwen2.5 uses: the tools listed as JSON
in the system turn, a call as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` and the reply as
`<tool_response>...</tool_response>` inside a user turn. The markers that the tokenizer lacks are added as tokens
(not special: they decode as text, as in Qwen's tokenizer), the embedding grows to a multiple of 64 rows, and each
new row starts as the mean of the rows of the pieces its text split into before (so `<tool_call>` begins where the
model already read "<tool_call>"). Another family's template can be given as a file.

What was done is recorded in the directory's rstar2_model.json (`tool_template`, `added_tokens`, `vocab_rows`),
and the template is the tokenizer's own, so SFT, the engines, the trainer, evaluation, `solve` and `export` all read
the same format; `rstar2 check` names the record.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from rstar2.core.checkpoint import require_new, write_dir_atomic
from rstar2.models.gguf import RECORD
from rstar2.rollout.chat import ChatFormat, ChatTemplateError, load_tokenizer

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
MARKERS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
ROWS_MULTIPLE = 64  # embedding rows are padded to this (ids past the tokenizer's are no token, as in Qwen's)

# Qwen2.5's tool format for ChatML turns, written for this project: the system turn (its content, then the tools
# block when tools are given), Hermes JSON tool calls after the assistant's content, consecutive tool replies in one
# user turn
HERMES_CHATML = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' or (message['role'] == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' and not message.get('tool_calls') %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
    "{%- for tool_call in message['tool_calls'] %}"
    "{%- set call = tool_call['function'] if tool_call['function'] is defined else tool_call %}"
    "{{- '\\n<tool_call>\\n{\"name\": ' + (call['name'] | tojson) + ', \"arguments\": ' }}"
    "{%- if call['arguments'] is string %}{{- call['arguments'] }}{%- else %}{{- call['arguments'] | tojson }}"
    "{%- endif %}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def record(model_dir: str | Path) -> dict:
    """What rstar2 did to a model directory (rstar2_model.json; {} for a model it never touched)."""
    path = Path(model_dir) / RECORD
    return json.loads(path.read_text()) if path.is_file() else {}


def carry(src: str | Path, dst: str | Path) -> None:
    """Copy the record from a model directory to one made from it (SFT's output, an RL checkpoint, an export)."""
    if (Path(src) / RECORD).is_file():
        shutil.copy2(Path(src) / RECORD, Path(dst) / RECORD)


def supports_tools(model_dir: str | Path) -> bool:
    try:
        ChatFormat.load(model_dir)
    except ChatTemplateError:
        return False
    return True


def add(model_dir: str | Path, out: str | Path, template: str | None = None) -> dict:
    """Write `model_dir`'s model to `out` (new, created whole or not at all) with a tool-aware chat template
    (`template`, Jinja text; default: HERMES_CHATML, for ChatML families only) and the tool markers its tokenizer
    lacks as new tokens, the embedding resized. A model whose own template already handles tools is refused (nothing
    to do), and so is a template that still cannot run the agent loop. Returns the record written."""
    src, out = Path(model_dir), Path(out)
    require_new(out, "add-tools")
    tok = load_tokenizer(src)
    if supports_tools(src):
        raise ValueError(f"{src}: its chat template already handles tools; use the model as it is")
    vocab = tok.get_vocab()
    if template is None and not (IM_START in vocab and IM_END in vocab):
        raise ValueError(f"{src}: not a ChatML model (no {IM_START}/{IM_END} tokens), so the built-in Hermes "
                         "template does not fit it: give its family's tool template as a file (--template)")
    missing = [m for m in MARKERS if m not in vocab]
    pieces = {m: tok(m, add_special_tokens=False)["input_ids"] for m in missing}  # before they are tokens
    tok.add_tokens(missing, special_tokens=False)
    tok.chat_template = template or HERMES_CHATML
    ChatFormat.of(tok, f"{src} with the tool template")  # the new format must run the loop, else nothing is written
    done = {"tool_template": "hermes-chatml" if template is None else "custom", "added_tokens":
            {m: tok.convert_tokens_to_ids(m) for m in missing}}

    def write(tmp: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(src), dtype="auto")
        emb = model.get_input_embeddings().weight
        rows_before = emb.shape[0]
        if len(tok) > rows_before:
            model.resize_token_embeddings(len(tok), pad_to_multiple_of=ROWS_MULTIPLE, mean_resizing=False)
            with torch.no_grad():
                emb = model.get_input_embeddings().weight
                for m, ids in pieces.items():
                    emb[tok.convert_tokens_to_ids(m)] = emb[ids].mean(0)
                out_emb = model.get_output_embeddings()
                if out_emb is not None and out_emb.weight.data_ptr() != emb.data_ptr():  # untied head: same rows
                    for m, ids in pieces.items():
                        out_emb.weight[tok.convert_tokens_to_ids(m)] = out_emb.weight[ids].mean(0)
        done["vocab_rows"] = {"before": rows_before, "after": model.get_input_embeddings().weight.shape[0]}
        model.save_pretrained(str(tmp), safe_serialization=True)
        tok.save_pretrained(str(tmp))
        if (src / "generation_config.json").is_file() and not (tmp / "generation_config.json").is_file():
            shutil.copy2(src / "generation_config.json", tmp / "generation_config.json")
        (tmp / RECORD).write_text(json.dumps({**record(src), **done}, indent=1))

    write_dir_atomic(out, write)
    return record(out)
