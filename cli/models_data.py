"""`rstar2 model ...|data ...|sft`: what a campaign starts from — a pretrained model brought in (a GGUF file as a
Hugging Face directory; a tool template and its tokens for a model whose own template has no tool support), problem
data imported into the schema, and SFT of any chat model on its transcripts. Each prints what it did and writes it
with --json; torch loads inside the commands that train or convert."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from rstar2.cli import env, tables
from rstar2.cli.output import console, write_json
from rstar2.cli.refuse import check_preset, fail
from rstar2.core import checkpoint, config
from rstar2.data import FORMATS
from rstar2.evaluation.export import model_dir
from rstar2.models import gguf, tools

models_app = typer.Typer(add_completion=False, no_args_is_help=True,
                         help="Bring a pretrained model in: GGUF to Hugging Face, a tool template for a model without "
                              "one")
SOURCE_HELP = "a .gguf file, or pkg:<module>/<file> inside an installed package"


def _report(title: str, out: Path, json_path: Optional[Path]) -> None:
    rec = {"model_dir": str(out), **tools.record(out)}
    table = Table(title=escape(title))
    table.add_column("what")
    table.add_column("value")
    for key, value in rec.items():
        table.add_row(key, escape(json.dumps(value) if isinstance(value, (dict, list)) else str(value)))
    console.print(table)
    write_json(json_path, rec)


@models_app.command("convert")
def convert(source: str = typer.Argument(..., help=SOURCE_HELP),
            out: Path = typer.Option(..., help="the directory to write (new, or empty)"),
            json_path: Optional[Path] = typer.Option(None, "--json", help="write what was done here")):
    """A GGUF file as a plain Hugging Face model directory: float32 safetensors, config, the tokenizer (its
    pre-tokenisation, special tokens and eos) and its chat template, as the file has them."""
    try:
        gguf.convert(source, out)
    except (ValueError, FileNotFoundError, FileExistsError, ImportError) as e:
        fail(e)
    _report(f"rstar2 model convert {source}", out, json_path)


@models_app.command("add-tools")
def add_tools(model: Path = typer.Option(..., help="a Hugging Face model directory whose template lacks tools"),
              out: Path = typer.Option(..., help="the directory to write (new, or empty)"),
              template: Optional[Path] = typer.Option(None, exists=True, dir_okay=False,
                                                      help="a Jinja chat template with tool support (default: the "
                                                           "Hermes one, for ChatML models)"),
              json_path: Optional[Path] = typer.Option(None, "--json", help="write what was done here")):
    """Give a model a tool-aware chat template (Hermes tool calls, as Qwen's) and add the tool-call and
    tool-response markers its tokenizer lacks as tokens, the embedding resized; recorded in rstar2_model.json."""
    try:
        tools.add(model_dir(model), out, template.read_text() if template else None)
    except (ValueError, FileExistsError) as e:
        fail(e)
    _report(f"rstar2 model add-tools {model}", out, json_path)


@models_app.command("import")
def import_model(source: str = typer.Argument(..., help=f"{SOURCE_HELP}, or a Hugging Face model directory"),
                 out: Path = typer.Option(..., help="the directory to write (new, or empty)"),
                 json_path: Optional[Path] = typer.Option(None, "--json", help="write what was done here")):
    """Both steps, as `world.import_model` does: convert a GGUF file (or copy a directory), then add the tool
    template where the model's own lacks tool support."""
    from rstar2.models import importer as models_importer

    try:
        checkpoint.require_new(out, "import")
        out.parent.mkdir(parents=True, exist_ok=True)
        models_importer.bring_in(source, out)
    except (ValueError, FileNotFoundError, FileExistsError, ImportError) as e:
        fail(e)
    _report(f"rstar2 model import {source}", out, json_path)


data_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Problem data in the schema RL and "
                                                                       "evaluation read (rstar2/data/schema.py)")


@data_app.command("import")
def data_import(src: Path = typer.Argument(..., help="JSONL or Parquet file"),
                out: Path = typer.Option(..., "--out", help="the Parquet file to write"),
                fmt: str = typer.Option("auto", "--format", help="auto (detected from the columns) or one of: " +
                                        ", ".join(FORMATS)),
                split: str = typer.Option("rl", help="rl: integer answers only (the paper's filter); eval: all"),
                preset: str = typer.Option("tiny", help="its eval.suites are what the data is decontaminated "
                                                        "against; its data section sets the thresholds"),
                set_: list[str] = typer.Option([], "--set"),
                json_path: Optional[Path] = typer.Option(None, "--json", help="write the report's figures here")):
    """Import a problem set (verl's or DAPO-Math-17k's chat-prompt layout, GSM8K, problem/solution, problem/answer,
    GPQA) into the problem schema: instruction sentences stripped, normalised, filtered, deduplicated, decontaminated;
    a report of what was dropped and why; logged to MLflow. No row left: the report, one line why, exit 1."""
    from rstar2.data import importer, suites  # polars: loaded when the command runs

    if fmt not in ("auto", *FORMATS) or split not in ("rl", "eval"):
        fail(f"--format is auto, {', '.join(FORMATS)}; --split is rl or eval")
    try:
        cfg = config.load(preset, set_)
        against = suites.problems(cfg.eval.suites, cfg.eval.seed)
        df, rep = importer.import_problems(str(src), fmt, split, cfg.data.near_dup_threshold, cfg.data.shingle_words,
                                           against, cfg.data.decontam_ngram, cfg.seed)
    except ValueError as e:
        fail(e)
    console.print(tables.import_table(rep, str(out), len(cfg.eval.suites)))
    if df.height:
        out.parent.mkdir(parents=True, exist_ok=True)
        df.write_parquet(out)
    run_id = importer.log_to_mlflow(cfg.experiment, cfg.out_dir, str(out), rep)
    write_json(json_path, rep.to_dict())
    if not df.height:  # an empty table is no training set: nothing written, the report says why
        fail(f"{importer.nothing_left(rep)}; {out} not written (report in MLflow run {run_id})", 1)
    console.print(f"wrote {out}; MLflow run {run_id} (experiment {cfg.experiment})")


def sft(data: Path = typer.Option(..., exists=True, dir_okay=False, help="chat transcripts: JSON lines, one "
                                  "{'messages': [...]} each (README: Your own model and data)"),
        model: Path = typer.Option(..., exists=True, file_okay=False, help="the HF model directory to start from"),
        out: Path = typer.Option(..., help="where the SFT'd model goes (a committed HF model directory)"),
        preset: str = typer.Option("tiny", help="the preset whose sft.* settings apply"),
        set_: list[str] = typer.Option([], "--set", help="override, e.g. --set sft.lr=1e-5 --set sft.packed=true"),
        json_path: Optional[Path] = typer.Option(None, "--json", help="write the figures here")):
    """Non-reasoning SFT of any chat model: its own template renders the transcripts, loss on assistant tokens."""
    env.apply()
    check_preset(preset, set_)
    from rstar2.training import sft as sft_lib  # torch: loaded when the command runs

    if out.exists() and any(out.iterdir()) and not checkpoint.is_committed(out):
        fail(f"{out} exists and is not empty; give a new directory")
    try:
        res = sft_lib.train_and_commit(config.load(preset, set_), model, data, out,
                                       {"base_model": str(model), "data": str(data)})
    except (ValueError, FileExistsError) as e:  # a model the pipeline cannot run, bad transcripts, an existing --out
        fail(e)
    console.print(tables.sft_table(vars(res), out))
    write_json(json_path, vars(res))
