"""`rstar2 model ...`: bring a pretrained model in (a GGUF file as a Hugging Face directory; a tool template and its
tokens for a model whose own template has no tool support). Each prints what it did and writes it with --json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from rstar2.cli.refuse import console, fail

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Bring a pretrained model in: GGUF to Hugging "
                                                                   "Face, a tool template for a model without one")
SOURCE_HELP = "a .gguf file, or pkg:<module>/<file> inside an installed package"


def _report(title: str, out: Path, json_path: Optional[Path]) -> None:
    from rstar2.models import tools

    rec = {"model_dir": str(out), **tools.record(out)}
    table = Table(title=escape(title))
    table.add_column("what")
    table.add_column("value")
    for key, value in rec.items():
        table.add_row(key, escape(json.dumps(value) if isinstance(value, (dict, list)) else str(value)))
    console.print(table)
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(rec, indent=1))
        console.print(f"wrote {json_path}")


@app.command("convert")
def convert(source: str = typer.Argument(..., help=SOURCE_HELP),
            out: Path = typer.Option(..., help="the directory to write (new, or empty)"),
            json_path: Optional[Path] = typer.Option(None, "--json", help="write what was done here")):
    """A GGUF file as a plain Hugging Face model directory: float32 safetensors, config, the tokenizer (its
    pre-tokenisation, special tokens and eos) and its chat template, as the file has them."""
    from rstar2.models import gguf

    try:
        gguf.convert(source, out)
    except (ValueError, FileNotFoundError, FileExistsError, ImportError) as e:
        fail(e)
    _report(f"rstar2 model convert {source}", out, json_path)


@app.command("add-tools")
def add_tools(model: Path = typer.Option(..., help="a Hugging Face model directory whose template lacks tools"),
              out: Path = typer.Option(..., help="the directory to write (new, or empty)"),
              template: Optional[Path] = typer.Option(None, exists=True, dir_okay=False,
                                                      help="a Jinja chat template with tool support (default: the "
                                                           "Hermes one, for ChatML models)"),
              json_path: Optional[Path] = typer.Option(None, "--json", help="write what was done here")):
    """Give a model a tool-aware chat template (Hermes tool calls, as Qwen's) and add the tool-call and
    tool-response markers its tokenizer lacks as tokens, the embedding resized; recorded in rstar2_model.json."""
    from rstar2.evaluation.export import model_dir
    from rstar2.models import tools

    try:
        tools.add(model_dir(model), out, template.read_text() if template else None)
    except (ValueError, FileExistsError) as e:
        fail(e)
    _report(f"rstar2 model add-tools {model}", out, json_path)


@app.command("import")
def import_model(source: str = typer.Argument(..., help=f"{SOURCE_HELP}, or a Hugging Face model directory"),
                 out: Path = typer.Option(..., help="the directory to write (new, or empty)"),
                 json_path: Optional[Path] = typer.Option(None, "--json", help="write what was done here")):
    """Both steps, as `world.import_model` does: convert a GGUF file (or copy a directory), then add the tool
    template where the model's own lacks tool support."""
    from rstar2.models import importer
    from rstar2.core.checkpoint import require_new

    try:
        require_new(out, "import")
        out.parent.mkdir(parents=True, exist_ok=True)
        importer.bring_in(source, out)
    except (ValueError, FileNotFoundError, FileExistsError, ImportError) as e:
        fail(e)
    _report(f"rstar2 model import {source}", out, json_path)
