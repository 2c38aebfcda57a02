"""Model directories as `rstar2 solve` and `rstar2 export` take them, and the export itself.

In: a run's checkpoint (rstar2.core.checkpoint: the Hugging Face weights, config and tokenizer beside the trainer's
optimizer / RNG / DeepSpeed state, sealed by COMMITTED.json; an SFT model is the same without trainer state; a LoRA
run's holds the adapter instead of the weights, rstar2.core.adapter) or a plain Hugging Face model directory. Out: a
plain Hugging Face model directory (safetensors weights, config, generation config, tokenizer with its chat template)
and nothing else, which `vllm serve` and transformers load as is; an adapter is merged into its base's weights.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from rstar2.core import adapter, checkpoint
from rstar2.rollout.chat import ChatFormat

# what a Hugging Face causal LM directory is made of (weights possibly sharded); everything else stays behind
HF_FILES = ("*.safetensors", "model.safetensors.index.json", "config.json", "generation_config.json",
            "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
            "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model",
            "rstar2_model.json")  # what rstar2 gave the model (a tool template and its tokens), where it did


def model_dir(path: str | Path) -> Path:
    """`path`, checked to be a model directory (a run's checkpoint or a plain HF one); one clear error naming it and
    what it lacks otherwise."""
    d = Path(path)
    if not d.is_dir():
        raise ValueError(f"{d}: no such directory (expected a run's checkpoint or a Hugging Face model directory)")
    if adapter.is_adapter(d):
        adapter.base_of(d)  # its base must be here to merge into
    weights = (adapter.WEIGHTS,) if adapter.is_adapter(d) else ("config.json", "*.safetensors")
    missing = [what for what, found in (
        ("config.json", "config.json" not in weights or (d / "config.json").is_file()),
        (f"{weights[-1]} weights", any(d.glob(weights[-1]))),
        ("tokenizer (tokenizer.json or tokenizer.model)", (d / "tokenizer.json").is_file()
         or (d / "tokenizer.model").is_file())) if not found]
    if missing:
        raise ValueError(f"{d} is not a model directory: it has no {', no '.join(missing)}")
    return d


def export(src: str | Path, out: str | Path) -> Path:
    """Write `src`'s model as a plain HF model directory `out` (created whole or not at all); refuses an `out` that
    exists and is not empty, and a model whose chat template cannot render the tool conversation (ChatTemplateError)."""
    src, out = model_dir(src), Path(out)
    checkpoint.require_new(out, "export (it never overwrites)")
    ChatFormat.load(src)  # a model whose template cannot hold a tool conversation is refused, naming what it lacks

    def write(tmp: Path) -> None:
        merged = adapter.is_adapter(src)
        if merged:  # base + adapter as one set of weights, with the base's config
            adapter.merge(src, tmp)
        for pattern in HF_FILES:
            for f in src.glob(pattern):
                if not (merged and f.name.startswith("adapter_")):
                    shutil.copy2(f, tmp / f.name)
        if not (tmp / "generation_config.json").is_file():  # what generate() and `vllm serve` default to
            from transformers import AutoConfig, GenerationConfig

            GenerationConfig.from_model_config(AutoConfig.from_pretrained(tmp)).save_pretrained(tmp)

    return checkpoint.write_dir_atomic(out, write)
