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
             sft_checkpoint: Optional[str] = typer.Option(None, help="start RL from this committed SFT model"),
             json_path: Optional[Path] = typer.Option(None, "--json", help="write the summary figures here")):
    """Run a campaign end to end: world -> SFT -> RL stages -> evaluation (a Prefect flow, tracked in MLflow).
    Run it again with the same arguments to resume a killed or failed run from its last committed checkpoint."""
    env.apply()
    from rstar2 import config

    _check_preset(preset, set_)
    from flows.campaign import CampaignParams, campaign as campaign_flow

    summary = campaign_flow(CampaignParams(preset=preset, overrides=set_, run_name=run_name,
                                           sft_checkpoint=sft_checkpoint))
    table = Table(title=f"rstar2 campaign '{preset}': held-out pass@1 ({summary['eval_samples']} samples x "
                        f"{summary['eval_problems']} problems)")
    for col in ("checkpoint", "pass@1"):
        table.add_column(col)
    table.add_row("SFT", f"{summary['pass1_sft']:.3f}")
    table.add_row(f"after RL ({summary['steps']} steps)", f"{summary['pass1_rl']:.3f}")
    table.add_row("gain", f"{summary['pass1_gain']:+.3f}")
    console.print(table)
    console.print("stages: " + ", ".join(f"{k} (ended: {v})" for k, v in summary["stages"].items()))
    console.print(f"wall time {summary['wall_s']:.0f} s; run dir {summary['run_dir']}")
    _write_json(json_path, summary)


def _check_preset(preset: str, overrides: list[str]) -> None:
    """Fail fast, with one clear message, before anything starts."""
    from rstar2 import config

    try:
        config.load(preset, overrides)
    except Exception as e:  # noqa: BLE001 - shown to the user as one line
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2)


@app.command()
def ablation(preset: str = typer.Option("tiny", help="preset name or YAML path"),
             variants: str = typer.Option("roc,plain-grpo", help="comma-separated: roc, plain-grpo, overlong-filter, "
                                                                  "no-tool"),
             set_: list[str] = typer.Option([], "--set", help="override applied to every variant"),
             name: str = typer.Option("ablation", help="run directories are <name>-<variant>"),
             sft_checkpoint: Optional[str] = typer.Option(None, help="share this committed SFT model"),
             json_path: Optional[Path] = typer.Option(None, "--json", help="write the figures here")):
    """Compare RL recipes from one shared SFT model (GRPO-RoC vs plain GRPO, ...); plots and figures in MLflow."""
    env.apply()
    _check_preset(preset, set_)
    from rstar2 import ablations

    chosen = [v.strip() for v in variants.split(",") if v.strip()]
    try:
        [ablations.overrides(v) for v in chosen]
    except ValueError as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2)
    from flows.ablation import AblationParams, ablation as ablation_flow

    res = ablation_flow(AblationParams(preset=preset, variants=chosen, overrides=set_, name=name,
                                       sft_checkpoint=sft_checkpoint))
    table = Table(title=f"rstar2 ablation '{name}' on '{preset}': held-out pass@1")
    for col in ("variant", "SFT", "after RL", "gain", "steps", "wall s"):
        table.add_column(col)
    for r in res["variants"]:
        table.add_row(r["variant"], f"{r['pass1_sft']:.3f}", f"{r['pass1_rl']:.3f}", f"{r['gain']:+.3f}",
                      str(r["steps"]), str(r["wall_s"]))
    console.print(table)
    steps = Table(title="per step (train batch): reward, pass@1, tool-error rate among positives, response length")
    cols = ["variant", "step", "reward_mean", "pass1_train", "tool_error_rate_pos", "response_len_mean"]
    for col in cols:
        steps.add_column(col)
    for r in res["per_step"]:
        steps.add_row(*[str(r.get(c, "")) for c in cols])
    console.print(steps)
    console.print(f"plots: {res['plots']} (also in MLflow, run {res['mlflow_run_id']})")
    _write_json(json_path, res)


@app.command()
def evaluate(preset: str = typer.Option("tiny"), run_name: Optional[str] = typer.Option(None),
             checkpoint: Optional[str] = typer.Option(None, help="default: the run's newest committed checkpoint"),
             split: Optional[str] = typer.Option(None, help="test or val (default: the preset's eval.split)"),
             set_: list[str] = typer.Option([], "--set"),
             json_path: Optional[Path] = typer.Option(None, "--json")):
    """Evaluate a checkpoint (pass@1 over k samples); the result goes to its MLflow LoggedModel."""
    env.apply()
    _check_preset(preset, set_)
    from flows.evaluate import EvalParams, evaluate as evaluate_flow

    res = evaluate_flow(EvalParams(preset=preset, overrides=set_, run_name=run_name, checkpoint=checkpoint,
                                   split=split))
    table = Table(title="rstar2 evaluate")
    for col in ("pass@1", "samples", "problems", "mean response length"):
        table.add_column(col)
    table.add_row(f"{res['pass1']:.3f}", str(res["samples"]), str(res["problems"]), f"{res['response_len_mean']:.0f}")
    console.print(table)
    _write_json(json_path, res)


@app.command()
def serve(prefect_port: int = 4200, mlflow_port: int = 5000,
          out_dir: Path = typer.Option(Path("runs"), help="where runs and the shared MLflow store live"),
          worker: bool = typer.Option(True, help="also run a worker for the deployments' runs")):
    """Local services on 127.0.0.1: Prefect server, MLflow server, and a runner serving prefect.yaml's deployments."""
    env.apply()
    from rstar2 import services

    services.serve(prefect_port, mlflow_port, out_dir.resolve(), worker, console.print)


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
