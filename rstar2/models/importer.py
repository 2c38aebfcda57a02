"""A pretrained model brought in as a run's initial model: a GGUF file converted (rstar2.models.gguf) or a Hugging
Face directory copied, then given the tool template and marker tokens when its own template lacks tool support
(rstar2.models.tools). One directory results, written whole or not at all."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from rstar2.core.checkpoint import write_dir_atomic
from rstar2.data import files
from rstar2.models import gguf, tools


def is_gguf(source: str) -> bool:
    return str(source).endswith(".gguf")


def bring_in(source: str, out: str | Path) -> dict:
    """`source` (a GGUF file, by path or `pkg:<module>/<file>`, or a HF model directory) as the model directory
    `out`, tool-aware; returns its record (rstar2_model.json: source, and what `tools.add` changed, if anything)."""
    out = Path(out)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".import-{out.name}-") as tmp:
        plain = Path(tmp) / "plain"
        if is_gguf(source):
            gguf.convert(source, plain)
        elif (Path(source) / "config.json").is_file():
            shutil.copytree(source, plain)
        else:
            raise ValueError(f"world.import_model {source}: neither a GGUF file nor a Hugging Face model directory")
        if tools.supports_tools(plain):
            write_dir_atomic(out, lambda d: shutil.copytree(plain, d, dirs_exist_ok=True))
        else:
            tools.add(plain, out)
    return tools.record(out)


def config_of(source: str):
    """The model's transformers config without loading its weights (what `rstar2 plan` sizes a run from)."""
    from transformers import AutoConfig

    if is_gguf(source):
        path = files.locate(source)
        return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    return AutoConfig.from_pretrained(source)
