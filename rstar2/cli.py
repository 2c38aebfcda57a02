"""`rstar2` command line (typer). Every command that measures or summarises prints a table and takes --json PATH."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from rstar2 import bench_trainer, env

app = typer.Typer(add_completion=False, no_args_is_help=True, help="rStar2-Agent: agentic RL for math with a Python tool")
console = Console()


def _write_json(path: Optional[Path], data: dict) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1))
        console.print(f"wrote {path}")


@app.command()
def campaign(preset: str = typer.Option("tiny", help="preset name or YAML path"),
             set_: list[str] = typer.Option([], "--set", help="override, e.g. --set stages.0.steps=5"),
             run_name: Optional[str] = typer.Option(None, help="run directory name (default: the preset's name)"),
             json_path: Optional[Path] = typer.Option(None, "--json", help="write the summary figures here")):
    """Run a campaign end to end: world -> SFT -> RL stages -> evaluation (a Prefect flow, tracked in MLflow)."""
    env.apply()
    from rstar2 import config

    try:
        config.load(preset, set_)  # fail fast, with one clear message, before anything starts
    except Exception as e:  # noqa: BLE001 - shown to the user as one line
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2)
    from flows.campaign import CampaignParams, campaign as campaign_flow

    summary = campaign_flow(CampaignParams(preset=preset, overrides=set_, run_name=run_name))
    table = Table(title=f"rstar2 campaign '{preset}': held-out pass@1 ({summary['eval_samples']} samples x "
                        f"{summary['eval_problems']} problems)")
    for col in ("checkpoint", "pass@1"):
        table.add_column(col)
    table.add_row("SFT", f"{summary['pass1_sft']:.3f}")
    table.add_row(f"after RL ({summary['steps']} steps)", f"{summary['pass1_rl']:.3f}")
    table.add_row("gain", f"{summary['pass1_gain']:+.3f}")
    console.print(table)
    console.print(f"wall time {summary['wall_s']:.0f} s; run dir {summary['run_dir']}")
    _write_json(json_path, summary)


@app.command()
def presets():
    """List the available presets."""
    from rstar2 import config

    for name in config.list_presets():
        console.print(name)


@app.command("config")
def show_config(preset: str = "tiny", set_: list[str] = typer.Option([], "--set")):
    """Print the resolved config of a preset (with overrides)."""
    from rstar2 import config

    try:
        console.print_json(config.load(preset, set_).model_dump_json())
    except Exception as e:  # noqa: BLE001
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2)


bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks: each prints a table and takes --json PATH")
app.add_typer(bench_app, name="bench")
bench_app.command("trainer")(bench_trainer.command)  # light import: torch/TRL load in the bench's workers


if __name__ == "__main__":
    app()
