"""`rstar2 evaluate|solve|export|analyze`: what a trained model does — pass@k on a split or the suites, one
trajectory turn by turn, the model written out as a plain Hugging Face directory, the entropy of its tokens. The
flows and the engine load inside the commands that use them."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from rstar2.cli import env, tables
from rstar2.cli.output import console, write_json
from rstar2.cli.refuse import check_preset, fail
from rstar2.core import config
from rstar2.core.layout import RunLayout
from rstar2.evaluation import export as exporting
from rstar2.rollout.chat import ChatTemplateError


def evaluate(preset: str = typer.Option("tiny"), run_name: Optional[str] = typer.Option(None),
             checkpoint: Optional[str] = typer.Option(None, help="default: the run's newest committed checkpoint"),
             model: Optional[Path] = typer.Option(None, help="a plain Hugging Face model directory instead of a "
                                                            "run's checkpoint"),
             split: Optional[str] = typer.Option(None, help="test or val (default: the preset's eval.split)"),
             set_: list[str] = typer.Option([], "--set"),
             json_path: Optional[Path] = typer.Option(None, "--json")):
    """Evaluate a checkpoint or a model directory (pass@1 over k samples) on the world's split or on eval.suites
    (one table, suite x metric); the result goes to its MLflow LoggedModel."""
    env.apply()
    check_preset(preset, set_)
    from rstar2.flows.evaluate import EvalParams
    from rstar2.flows.evaluate import evaluate as evaluate_flow

    if model is not None and not (model / "config.json").is_file():
        fail(f"{model} is not a Hugging Face model directory (it has no config.json)")
    res = evaluate_flow(EvalParams(preset=preset, overrides=set_, run_name=run_name, checkpoint=checkpoint,
                                   model=str(model) if model else None, split=split))
    if "suites" not in res:  # else the evaluation printed its suite table
        console.print(tables.evaluate_table(res))
    write_json(json_path, res)


def solve(problem: str = typer.Argument(..., help="the problem text"),
          checkpoint: Path = typer.Option(..., help="a run's checkpoint or a Hugging Face model directory"),
          answer: Optional[str] = typer.Option(None, help="the gold answer: also print the reward"),
          temperature: Optional[float] = typer.Option(None, help="default: the preset's eval.temperature"),
          max_turns: Optional[int] = typer.Option(None, help="default: the preset's eval.max_turns"),
          seed: int = typer.Option(0, help="sampling seed"),
          preset: Optional[str] = typer.Option(None, help="engine, sandbox and length settings (context: "
                                                           "world.max_positions, response: "
                                                           "eval.max_response_tokens); default: the config of "
                                                           "the checkpoint's run, else tiny"),
          set_: list[str] = typer.Option([], "--set"),
          json_path: Optional[Path] = typer.Option(None, "--json", help="write the trajectory here")):
    """Run one trajectory of a model on a problem and print it turn by turn: reasoning, code, tool output, the final
    answer, and with --answer the reward (the same agent loop, sandbox and reward check as RL)."""
    env.apply()
    from rstar2.run import solve as solving  # the engine: loaded when the command runs

    try:
        exporting.model_dir(checkpoint)
    except ValueError as e:
        fail(e)
    if preset is None:
        found = RunLayout.config_of(checkpoint)
        preset = str(found) if found else "tiny"
        console.print(f"settings: {preset}", style="dim")
    check_preset(preset, set_)
    try:
        rec = solving.solve(str(checkpoint), problem, config.load(preset, set_), answer, temperature, max_turns, seed)
    except ChatTemplateError as e:  # one line, with the way forward
        fail(f"{e}; `rstar2 model add-tools --model {checkpoint} --out DIR` gives a model a tool template")
    for part in tables.trajectory_view(rec):
        console.print(part)
    write_json(json_path, rec)


def export(checkpoint: Path = typer.Option(..., help="a run's checkpoint or a Hugging Face model directory"),
           out: Path = typer.Option(..., help="the directory to write (new, or empty)")):
    """Write a model as a plain Hugging Face model directory (weights, config, generation config, tokenizer with its
    chat template; no optimizer or trainer state) that `vllm serve` and transformers load."""
    try:
        path = exporting.export(checkpoint, out)
    except (ValueError, FileExistsError) as e:
        fail(e)
    console.print(f"wrote {path}: {', '.join(sorted(p.name for p in path.iterdir()))}")


analyze_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Analyses of a run's policy (paper §5)")


@analyze_app.command("entropy")
def analyze_entropy(run: str = typer.Option(..., "--run", help="the run's name (its directory under the preset's "
                                                              "out_dir)"),
                    preset: str = typer.Option("tiny", help="the preset whose out_dir holds the run"),
                    checkpoint: list[str] = typer.Option([], "--checkpoint", help="a model directory, repeatable, "
                                                         "in order (default: the SFT model, then the newest RL "
                                                         "checkpoint)"),
                    trajectories: Optional[Path] = typer.Option(None, help="a rollout table (default: the last RL "
                                                                           "step's scored.parquet)"),
                    rl_seed: Optional[int] = typer.Option(None, help="with several RL seeds: which (default: lowest)"),
                    samples: int = typer.Option(64, min=1, help="trajectories drawn from the table"),
                    window: int = typer.Option(8, min=1, help="model tokens after a tool response counted as "
                                                              "reflection tokens (the paper names no number)"),
                    top_frac: float = typer.Option(0.2, min=0.01, max=0.99, help="the high-entropy set: this top "
                                                                                 "fraction of tokens (paper: 0.2)"),
                    json_path: Optional[Path] = typer.Option(None, "--json", help="write the figures here")):
    """Per-token entropy of the policy on the run's own trajectories, the top-entropy tokens split into forking
    (reasoning) and reflection (right after a tool response) tokens, from the SFT model to the end of RL."""
    env.apply()
    check_preset(preset, [])
    from rstar2.flows.analyze_entropy import EntropyParams, run_paths
    from rstar2.flows.analyze_entropy import analyze_entropy as entropy_flow

    try:
        params = EntropyParams(preset=preset, run_name=run, rl_seed=rl_seed, checkpoints=checkpoint,
                               trajectories=str(trajectories) if trajectories else None, samples=samples,
                               window=window, top_frac=top_frac)
        run_paths(params)  # a missing run fails here with one line, before Prefect starts
    except ValueError as e:
        fail(e)
    res = entropy_flow(params)
    console.print(tables.entropy_table(res, run, top_frac, window, samples))
    for line in tables.entropy_top_strings(res):
        console.print(line)
    console.print(f"plots: {', '.join(res['plots'])} (also in MLflow, run {res['mlflow_run_id']})")
    write_json(json_path, res)
