"""`rstar2 export` (rstar2.evaluation.export): a run's checkpoint (weights beside the trainer's optimizer/RNG state,
sealed) in, a plain Hugging Face model directory out that transformers loads with the same logits; what is not a model,
or an existing directory, is refused with one clear error. Loading the export in vLLM: tests/engine/test_look.py."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rstar2.core import checkpoint, config
from rstar2.core.config import TrainerCfg
from rstar2.evaluation import export
from rstar2.rollout.chat import load_tokenizer as load
from rstar2.training.trainer import STATE_FILE, PolicyTrainer
from rstar2.world import build

TINY = ["world.n_sft=60", "world.n_train=12", "world.n_test=6", "world.hidden=32", "world.ffn=64", "world.layers=2",
        "world.heads=2", "world.kv_heads=1", "world.vocab_size=600"]


@pytest.fixture(scope="module")
def run_checkpoint(tmp_path_factory):
    """A committed RL checkpoint of the tiny world's model, as a campaign writes it."""
    init = build.build(config.load("tiny", TINY), tmp_path_factory.mktemp("world"))["init_model"]
    root = tmp_path_factory.mktemp("run")
    saved = PolicyTrainer(init, TrainerCfg(device="cpu")).save(str(root / "checkpoints" / "stage1" / "step-0001"),
                                                               {"step": 1})
    return Path(saved)


def _logits(model_dir, ids):
    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)(input_ids=ids).logits


def test_export_writes_a_plain_model_directory_with_the_same_logits(run_checkpoint, tmp_path):
    src = run_checkpoint
    assert checkpoint.is_committed(src) and (src / STATE_FILE).is_file()  # what the export must leave behind
    out = export.export(src, tmp_path / "hf")
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    assert not names & {STATE_FILE, checkpoint.MARKER}  # no trainer state, no checkpoint seal
    assert not any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())
    tok_src, tok_out = load(src), load(out)
    assert tok_out.chat_template == tok_src.chat_template and tok_out.eos_token == "<|im_end|>"
    ids = torch.tensor([tok_src("Compute 12 * 7.")["input_ids"]])
    assert torch.equal(_logits(out, ids), _logits(src, ids))
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok_src.eos_token_id  # generation stops at the end of the assistant's turn

    with pytest.raises(FileExistsError, match="not empty"):
        export.export(src, out)


def test_what_is_not_a_model_is_refused_naming_what_it_lacks(run_checkpoint, tmp_path):
    with pytest.raises(ValueError, match="no such directory"):
        export.model_dir(tmp_path / "nowhere")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"half is not a model directory: it has no \*\.safetensors weights, no "
                                         r"tokenizer"):
        export.model_dir(tmp_path / "half")
    bare = tmp_path / "bare"  # a model whose tokenizer has no chat template
    export.export(run_checkpoint, bare)
    cfg = json.loads((bare / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(cfg))
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(ValueError, match="bare: the tokenizer has no usable chat template"):
        export.export(bare, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_lora_checkpoint_is_exported_merged_into_its_base(tmp_path):
    """A LoRA run's checkpoint holds the adapter alone: the export is base + adapter as one plain model directory
    (transformers loads it; its logits are the trainer's to fp32 rounding of the merge)."""
    init = build.build(config.load("tiny", TINY), tmp_path / "world")["init_model"]
    tr = PolicyTrainer(init, TrainerCfg(device="cpu", lr=5e-2, warmup_steps=1, lora=config.LoraCfg(rank=4, alpha=8)))
    for p in tr.model.parameters():  # an adapter that moved (B is zero when fresh)
        if p.requires_grad:
            p.data.normal_(0, 0.05)
    src = Path(tr.save(str(tmp_path / "run" / "step-0001"), {"step": 1}))
    assert not (src / "config.json").is_file()  # the adapter and the tokenizer, no weights of the model
    out = export.export(src, tmp_path / "hf")
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    assert not any(n.startswith("adapter_") for n in names)
    ids = torch.tensor([load(src)("Compute 12 * 7.")["input_ids"]])
    with torch.no_grad():
        trained = tr.model(input_ids=ids).logits
    assert torch.allclose(_logits(out, ids), trained, atol=1e-5) and not torch.allclose(_logits(init, ids), trained)
    cfg = json.loads((src / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = str(tmp_path / "gone")
    (src / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="base model .*gone.* is not a model directory"):
        export.export(src, tmp_path / "hf2")
