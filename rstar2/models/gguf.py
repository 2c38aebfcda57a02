"""A GGUF file (llama.cpp's format: weights, tokenizer and chat template in one file) as a plain Hugging Face model
directory that vLLM, the trainer and every other part of the pipeline load: safetensors weights dequantised to
float32, config.json, the tokenizer (tokenizer.json: the family's pre-tokenisation, digits included, its special
tokens and eos) and the chat template. transformers reads the file (`gguf_file=`, with the `gguf` package); its
model refuses `save_pretrained`, so its state dict goes into a plain model of the same class.

A model file is named by path, or as `pkg:<module>/<file>` inside an installed distribution (rstar2.data.files).
"""

from __future__ import annotations

import json
from pathlib import Path

from rstar2.core.checkpoint import require_new, sha256, write_dir_atomic
from rstar2.data.files import locate

RECORD = "rstar2_model.json"  # what was done to a model directory: its source, and tools.add's changes


def convert(source: str | Path, out: str | Path) -> Path:
    """Write the GGUF model `source` (see `locate`) as a plain HF model directory `out` (created whole or not at
    all; an existing non-empty `out` is refused). Returns `out`."""
    path, out = locate(source), Path(out)
    require_new(out, "the conversion")
    try:
        from gguf import GGUFReader  # noqa: F401 - transformers reads GGUF files through it
    except ImportError:
        raise ImportError("reading a GGUF file needs the `gguf` package (in the project's lock)") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def write(tmp: Path) -> None:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype="float32")
        config = loaded.config
        for attr in ("quantization_config", "_name_or_path"):
            if hasattr(config, attr):
                delattr(config, attr)
        model = type(loaded)(config)  # a plain model: the GGUF-loaded one refuses save_pretrained
        model.load_state_dict(loaded.state_dict())
        model.generation_config.eos_token_id = tok.eos_token_id  # a chat model stops on its end of turn
        model.save_pretrained(str(tmp), safe_serialization=True)
        tok.save_pretrained(str(tmp))
        (tmp / RECORD).write_text(json.dumps({"source": str(source), "file": path.name, "sha256": sha256(path),
                                              "format": "gguf"}, indent=1))

    return write_dir_atomic(out, write)


def vocabulary(source: str | Path) -> list[str]:
    """The GGUF file's own token list (`tokenizer.ggml.tokens`, by id): what a converted tokenizer must reproduce."""
    from gguf import GGUFReader

    field = GGUFReader(str(locate(source))).fields["tokenizer.ggml.tokens"]
    return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
