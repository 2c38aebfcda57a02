"""`rstar2` command line (typer). Every command that measures or summarises prints a table and takes --json PATH."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional

import typer
from rich.markup import escape
from rich.table import Table

from rstar2.bench import trainer as bench_trainer
from rstar2.cli import env, tables
from rstar2.cli.refuse import fail
from rstar2.data import FORMATS as DATA_FORMATS
from rstar2.core import progress

app = typer.Typer(add_completion=False, no_args_is_help=True, help="rStar2-Agent: agentic RL for math with a Python tool")
console = progress.console()


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
             seeds: int = typer.Option(1, min=1, help="RL seeds from the one SFT model (rl_seed, rl_seed+1, ...): "
                                                      "the gain's mean, min, max and 95 % interval over them"),
             world_seeds: int = typer.Option(1, min=1, help="worlds (seed, seed+1, ...), each with its own SFT "
                                                             "model and the RL seeds: every gain, their min, mean "
                                                             "and intervals"),
             json_path: Optional[Path] = typer.Option(None, "--json", help="write the summary figures here")):
    """Run a campaign end to end: world -> SFT -> RL stages -> evaluation (a Prefect flow, tracked in MLflow).
    Run it again with the same arguments to resume a killed or failed run from its last committed checkpoint."""
    env.apply()
    _check_preset(preset, set_)
    from rstar2.flows.campaign import CampaignParams, campaign as campaign_flow

    params = CampaignParams(preset=preset, overrides=set_, run_name=run_name, sft_checkpoint=sft_checkpoint,
                            seeds=seeds)
    if world_seeds > 1:
        from rstar2.flows.campaign_worlds import campaign_worlds

        if sft_checkpoint:
            fail("--world-seeds trains one SFT model per world; drop --sft-checkpoint")
        summary = _stopped(lambda: campaign_worlds(params, world_seeds))
        console.print(tables.worlds_table(summary, preset))
        console.print(f"wall time {summary['wall_s']:.0f} s; run dirs {', '.join(summary['world_run_dirs'].values())}")
        _write_json(json_path, summary)
        return
    summary = _stopped(lambda: campaign_flow(params))
    console.print(tables.campaign_table(summary, preset))
    if "suites_sft" in summary:
        console.print(tables.suites_table(summary))
    for s in summary["by_seed"]:
        console.print(f"stages (rl_seed {s['rl_seed']}): " + ", ".join(f"{k} (ended: {v})"
                                                                     for k, v in s["stages"].items()))
    if summary.get("speed"):
        console.print(tables.speed_line(summary["speed"]))
    console.print(f"wall time {summary['wall_s']:.0f} s; run dir {summary['run_dir']}")
    _write_json(json_path, summary)


def _stopped(run_flow: Callable[[], dict]) -> dict:
    """A campaign flow's summary; a run the preflight refused (or its tracking: a run resumed with other settings), or
    one a run-stopping check stopped, ends the command with that check's one line (under Prefect's log of it),
    anything else with its traceback."""
    from rstar2.run.preflight import PreflightError
    from rstar2.core.tracking import ChangedParams

    try:
        return run_flow()
    except Exception as e:  # noqa: BLE001 - sorted below: one line for the checks' own errors
        refused = _in_chain(e, (PreflightError, ChangedParams))
        if refused is not None:
            fail(refused, 1)
        if (stop := _run_stop(e)) is None:
            raise
        fail(f"{stop}\n(the run stopped; its committed steps stay: run the same command again to resume)", 1)


def _in_chain(e: BaseException | None, kinds: tuple[type, ...]) -> BaseException | None:
    """The first error of `kinds` in `e`'s chain of causes."""
    while e is not None and not isinstance(e, kinds):
        e = e.__cause__ or e.__context__
    return e


def _run_stop(e: BaseException) -> BaseException | None:
    """The check that stopped a run, if one did (a full disk, the rollout/train log-prob gap, the token stream against
    the template, the engines' weights against the checkpoint), unwrapped from Prefect's and Ray's errors around it;
    None for anything else."""
    from rstar2.rollout.stream_check import StreamMismatch
    from rstar2.core.checkpoint import DiskFull
    from rstar2.core.fingerprint import WeightSyncError
    from rstar2.training.trainer import LogprobGapError

    seen = _in_chain(e, (DiskFull, LogprobGapError, StreamMismatch, WeightSyncError))
    return seen and (getattr(seen, "cause", None) or seen)  # a RayTaskError(DiskFull) holds the DiskFull as its cause


def _check_preset(preset: str, overrides: list[str]) -> None:
    """Fail fast, with one clear message, before anything starts."""
    from rstar2.core import config
    from rstar2.run import plan
    try:
        plan.require_fit(config.load(preset, overrides))
    except Exception as e:  # noqa: BLE001 - shown to the user as one line
        fail(e)


@app.command("chaos")
def chaos_cmd(preset: str = typer.Option("tiny", help="preset name or YAML path"),
              set_: list[str] = typer.Option([], "--set", help="override, e.g. --set out_dir=/tmp/chaos"),
              row: list[str] = typer.Option([], "--row", help="a run's faults, `+` between several in one run "
                                            "(repeatable); default: none (the same run again), then each of engine, "
                                            "executor, server, trainer, flow, disk, mlflow, prefect in a run of its "
                                            "own"),
              outage_s: float = typer.Option(60.0, help="how long the MLflow server stays down"),
              sft_checkpoint: Optional[Path] = typer.Option(None, help="start every run from this committed SFT "
                                                          "model (e.g. a campaign's runs/<run>/sft) instead of "
                                                          "training one"),
              json_path: Optional[Path] = typer.Option(None, "--json", help="write every row's figures here")):
    """Kill parts of a shrunken campaign (3 RL steps) and compare each run with the same run without faults: per-step
    figures, kept rollouts and pass@1 to the digit, MLflow steps once, checkpoints whole. Exit 1 unless every run
    recovered (by itself or on one retry)."""
    from rstar2.cli import chaos

    env.apply()
    _check_preset(preset, set_)
    try:
        report = chaos.run_chaos(preset, set_, row or chaos.DEFAULT_ROWS, outage_s, sft_checkpoint, say=console.print)
    except (ValueError, RuntimeError) as e:
        fail(e)
    console.print(tables.chaos_table(report))
    _write_json(json_path, report)
    if not report["all_recovered"]:
        raise typer.Exit(1)


@app.command("plan")
def plan_cmd(preset: str = typer.Option("tiny", help="preset name or YAML path"),
             gpus: Optional[int] = typer.Option(None, min=0, help="accelerators (default: the preset's placement.gpus; "
                                                                   "0: this machine's RAM)"),
             gpu_mem: Optional[float] = typer.Option(None, "--gpu-mem", min=1, help="GB of one accelerator "
                                                     "(default: the preset's placement.gpu_mem_gb)"),
             set_: list[str] = typer.Option([], "--set", help="override, e.g. --set trainer.world_size=16"),
             json_path: Optional[Path] = typer.Option(None, "--json", help="write the figures here")):
    """Whether a preset fits its hardware: per-device memory of trainer ranks and engines, and a verdict. Exit code 1
    when it does not fit (a campaign refuses such a run before any actor starts)."""
    from rstar2.core import config
    from rstar2.run import plan
    try:
        res = plan.plan(config.load(preset, set_), gpus, gpu_mem)
    except Exception as e:  # noqa: BLE001 - shown to the user as one line
        fail(e)
    for table in tables.plan_tables(res, preset):
        console.print(table)
    console.print("[green]fits[/green]" if res["fits"] else "[red]does not fit[/red]")
    _write_json(json_path, res)
    if not res["fits"]:
        raise typer.Exit(1)


@app.command("check")
def check_cmd(preset: str = typer.Option("tiny", help="preset name or YAML path"),
              set_: list[str] = typer.Option([], "--set", help="override, e.g. --set world.max_positions=4096"),
              run_name: Optional[str] = typer.Option(None, help="the run directory whose world is checked (made "
                                                               "there when missing; default: the preset's name)"),
              sft_checkpoint: Optional[str] = typer.Option(None, help="the committed SFT model a campaign would start "
                                                                     "RL from: checked in place of the base model"),
              json_path: Optional[Path] = typer.Option(None, "--json", help="write the figures here")):
    """What a campaign checks before it starts: the model and its chat template, the context, every training and
    evaluation prompt against it (the ones without room for their response budget are dropped, with their ids),
    each of eval.suites, the SFT transcripts, the plan's verdict and the sandbox. Exit code 1 when the run cannot
    start; dropped prompts are warnings."""
    env.apply()
    from rstar2.core import config
    from rstar2.run import preflight, runstate
    try:
        cfg = config.load(preset, set_)
    except Exception as e:  # noqa: BLE001 - shown to the user as one line
        fail(e)
    res = preflight.run(cfg, runstate.layout(cfg, run_name), sft_checkpoint)
    console.print(tables.check_table(res, preset))
    warned = sum(c["status"] == preflight.WARN for c in res["checks"])
    console.print(f"[green]ready[/green] ({warned} warning(s))" if res["ok"] else "[red]cannot start[/red]")
    _write_json(json_path, res)
    if not res["ok"]:
        raise typer.Exit(1)


@app.command()
def ablation(preset: str = typer.Option("tiny-recovery", help="preset name or YAML path (default: the tiny world "
                                                                "where the policy recovers from tool errors)"),
             variants: str = typer.Option("roc,plain-grpo", help="comma-separated: roc, plain-grpo, overlong-filter, "
                                                                  "no-tool, overlap, partial, overlap-partial"),
             set_: list[str] = typer.Option([], "--set", help="override applied to every variant"),
             name: str = typer.Option("ablation", help="run directories are <name>-<variant>"),
             sft_checkpoint: Optional[str] = typer.Option(None, help="share this committed SFT model"),
             seeds: int = typer.Option(3, min=1, help="RL seeds per variant: each variant's spread over seeds, and "
                                                      "whether it differs from the first beyond that noise (seed "
                                                      "by seed for the tool-error rate among positives)"),
             world_seeds: Optional[int] = typer.Option(None, min=1, help="worlds (seed, seed+1, ...), each with its "
                                                                       "own SFT model shared by its variants, the "
                                                                       "runs pooled (default 2; 1 with "
                                                                       "--sft-checkpoint)"),
             last_steps: int = typer.Option(3, min=1, help="training figures at the end of RL: each seed's mean "
                                                           "over its last N steps"),
             json_path: Optional[Path] = typer.Option(None, "--json", help="write the figures here")):
    """Compare RL recipes from shared SFT models (GRPO-RoC vs plain GRPO, ...); plots and figures in MLflow."""
    env.apply()
    _check_preset(preset, set_)
    from rstar2.run import ablations
    chosen = [v.strip() for v in variants.split(",") if v.strip()]
    if sft_checkpoint and (world_seeds or 1) > 1:
        fail("--world-seeds trains one SFT model per world; drop --sft-checkpoint")
    try:
        [ablations.overrides(v) for v in chosen]
        from rstar2.flows.ablation import AblationParams, ablation as ablation_flow
        params = AblationParams(preset=preset, variants=chosen, overrides=set_, name=name,
                                sft_checkpoint=sft_checkpoint, seeds=seeds, world_seeds=world_seeds,
                                last_steps=last_steps)
    except ValueError as e:  # pydantic's ValidationError is one
        fail(e)
    res = ablation_flow(params)
    for t in tables.ablation_tables(res, name, preset):
        console.print(t)
    steps = Table(title="per step (train batch): reward, pass@1, tool-error rate among positives, response length")
    cols = ["variant", "step", "reward_mean", "pass1_train", "tool_error_rate_pos", "response_len_mean"]
    for col in cols:
        steps.add_column(col)
    for r in res["per_step"]:
        steps.add_row(*[str(r.get(c, "")) for c in cols])
    console.print(steps)
    for line in tables.ablation_conclusions(res):
        console.print(line)
    console.print(f"plots: {res['plots']} (also in MLflow, run {res['mlflow_run_id']})")
    _write_json(json_path, res)


@app.command()
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
    _check_preset(preset, set_)
    from rstar2.flows.evaluate import EvalParams, evaluate as evaluate_flow

    if model is not None and not (model / "config.json").is_file():
        fail(f"{model} is not a Hugging Face model directory (it has no config.json)")
    res = evaluate_flow(EvalParams(preset=preset, overrides=set_, run_name=run_name, checkpoint=checkpoint,
                                   model=str(model) if model else None, split=split))
    if "suites" in res:  # the evaluation printed its suite table
        _write_json(json_path, res)
        return
    console.print(tables.evaluate_table(res))
    _write_json(json_path, res)


@app.command("solve")
def solve_cmd(problem: str = typer.Argument(..., help="the problem text"),
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
    from rstar2.run import solve
    from rstar2.rollout.chat import ChatTemplateError
    from rstar2.core import config
    from rstar2.core.layout import RunLayout

    _check_model_dir(checkpoint)
    if preset is None:
        found = RunLayout.config_of(checkpoint)
        preset = str(found) if found else "tiny"
        console.print(f"settings: {preset}", style="dim")
    _check_preset(preset, set_)
    try:
        rec = solve.solve(str(checkpoint), problem, config.load(preset, set_), answer, temperature, max_turns, seed)
    except ChatTemplateError as e:  # one line, with the way forward
        fail(f"{e}; `rstar2 model add-tools --model {checkpoint} --out DIR` gives a model a tool template")
    for part in tables.trajectory_view(rec):
        console.print(part)
    _write_json(json_path, rec)


def _check_model_dir(path: Path) -> None:
    from rstar2.evaluation import export
    try:
        export.model_dir(path)
    except ValueError as e:
        fail(e)


@app.command("export")
def export_cmd(checkpoint: Path = typer.Option(..., help="a run's checkpoint or a Hugging Face model directory"),
               out: Path = typer.Option(..., help="the directory to write (new, or empty)")):
    """Write a model as a plain Hugging Face model directory (weights, config, generation config, tokenizer with its
    chat template; no optimizer or trainer state) that `vllm serve` and transformers load."""
    from rstar2.evaluation import export
    try:
        path = export.export(checkpoint, out)
    except (ValueError, FileExistsError) as e:
        fail(e)
    console.print(f"wrote {path}: {', '.join(sorted(p.name for p in path.iterdir()))}")


@app.command()
def sft(data: Path = typer.Option(..., exists=True, dir_okay=False, help="chat transcripts: JSON lines, one "
                                  "{'messages': [...]} each (README: Your own model and data)"),
        model: Path = typer.Option(..., exists=True, file_okay=False, help="the HF model directory to start from"),
        out: Path = typer.Option(..., help="where the SFT'd model goes (a committed HF model directory)"),
        preset: str = typer.Option("tiny", help="the preset whose sft.* settings apply"),
        set_: list[str] = typer.Option([], "--set", help="override, e.g. --set sft.lr=1e-5 --set sft.packed=true"),
        json_path: Optional[Path] = typer.Option(None, "--json", help="write the figures here")):
    """Non-reasoning SFT of any chat model: its own template renders the transcripts, loss on assistant tokens."""
    env.apply()
    _check_preset(preset, set_)
    from rstar2.core import checkpoint, config
    from rstar2.training import sft as sft_lib
    from rstar2.core.progress import bar

    cfg, res = config.load(preset, set_), {}

    def write(tmp: Path) -> None:
        with bar("SFT") as progress:
            res.update(vars(sft_lib.train_with(cfg, model, data, tmp, progress)))

    if out.exists() and any(out.iterdir()) and not checkpoint.is_committed(out):
        fail(f"{out} exists and is not empty; give a new directory")
    try:
        checkpoint.commit(out, write, {"kind": "sft", "base_model": str(model), "data": str(data)})
    except (ValueError, FileExistsError) as e:  # a model the pipeline cannot run, bad transcripts, an existing --out
        fail(e)
    table = Table(title=f"rstar2 sft -> {out}")
    for col in ("steps", "cycles: final loss", "tokens/s", "wall s"):
        table.add_column(col)
    table.add_row(str(res["steps"]), ", ".join(f"{x:.3f}" for x in res["cycle_losses"]), f"{res['tokens_per_s']:.0f}",
                  f"{res['wall_s']:.1f}")
    console.print(table)
    _write_json(json_path, res)


@app.command()
def serve(prefect_port: int = 4200, mlflow_port: int = 5000,
          out_dir: Path = typer.Option(Path("runs"), help="where runs and the shared MLflow store live"),
          worker: bool = typer.Option(True, help="also run a worker for the deployments' runs")):
    """Local services on 127.0.0.1: Prefect server, MLflow server, and a runner serving prefect.yaml's deployments."""
    env.apply()
    from rstar2.cli import services

    try:
        services.serve(prefect_port, mlflow_port, out_dir.resolve(), worker, console.print)
    except services.PortInUse as e:
        fail(e)


@app.command()
def presets():
    """List the available presets."""
    from rstar2.core import config
    for name in config.list_presets():
        console.print(name)


@app.command("config")
def show_config(preset: str = "tiny", set_: list[str] = typer.Option([], "--set")):
    """Print the resolved config of a preset (with overrides)."""
    from rstar2.core import config
    try:
        console.print_json(config.load(preset, set_).model_dump_json())
    except Exception as e:  # noqa: BLE001
        fail(e)


analyze_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Analyses of a run's policy (paper §5)")
app.add_typer(analyze_app, name="analyze")


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
    _check_preset(preset, [])
    from rstar2.flows.analyze_entropy import EntropyParams, analyze_entropy as entropy_flow, run_paths

    try:
        params = EntropyParams(preset=preset, run_name=run, rl_seed=rl_seed, checkpoints=checkpoint,
                               trajectories=str(trajectories) if trajectories else None, samples=samples,
                               window=window, top_frac=top_frac)
        run_paths(params)  # a missing run fails here with one line, before Prefect starts
    except ValueError as e:
        fail(e)
    res = entropy_flow(params)
    table = Table(title=escape(f"rstar2 analyze entropy '{run}': the top {top_frac:.0%} entropy tokens; forking = in "
                               f"reasoning, reflection = first {window} tokens after a tool response ({samples} "
                               f"trajectories of {res['trajectories']})"))
    for col in ("checkpoint", "tokens", "class", "class tokens", "mean entropy", "share of top", "class rate in top"):
        table.add_column(col, justify="left" if col in ("checkpoint", "class") else "right")
    for lbl, f in res["by_checkpoint"].items():
        for c, kind in (("reasoning", "forking"), ("reflection", "reflection")):
            table.add_row(lbl, str(f["tokens"]), kind, str(f[c]["tokens"]), f"{f[c]['entropy_mean']:.4f}",
                          f"{f[c]['share_of_high']:.3f}", f"{f[c]['high_rate']:.3f}")
    console.print(table)
    for lbl, f in res["by_checkpoint"].items():
        for c, kind in (("reasoning", "forking"), ("reflection", "reflection")):
            console.print(f"{lbl} {kind}: " + escape(", ".join(f"{s!r} {n}" for s, n in f[c]["top_strings"])))
    console.print(f"plots: {', '.join(res['plots'])} (also in MLflow, run {res['mlflow_run_id']})")
    _write_json(json_path, res)


data_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Problem data in the schema RL and "
                                                                       "evaluation read (rstar2/data/schema.py)")
app.add_typer(data_app, name="data")


@data_app.command("import")
def data_import(src: Path = typer.Argument(..., help="JSONL or Parquet file"),
                out: Path = typer.Option(..., "--out", help="the Parquet file to write"),
                fmt: str = typer.Option("auto", "--format", help="auto (detected from the columns) or one of: " +
                                        ", ".join(DATA_FORMATS)),
                split: str = typer.Option("rl", help="rl: integer answers only (the paper's filter); eval: all"),
                preset: str = typer.Option("tiny", help="its eval.suites are what the data is decontaminated "
                                                        "against; its data section sets the thresholds"),
                set_: list[str] = typer.Option([], "--set"),
                json_path: Optional[Path] = typer.Option(None, "--json", help="write the report's figures here")):
    """Import a problem set (verl's or DAPO-Math-17k's chat-prompt layout, GSM8K, problem/solution, problem/answer,
    GPQA) into the problem schema: instruction sentences stripped, normalised, filtered, deduplicated, decontaminated;
    a report of what was dropped and why; logged to MLflow. No row left: the report, one line why, exit 1."""
    from rstar2.core import config
    from rstar2.data import FORMATS, importer, suites

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
    _write_json(json_path, rep.to_dict())
    if not df.height:  # an empty table is no training set: nothing written, the report says why
        fail(f"{importer.nothing_left(rep)}; {out} not written (report in MLflow run {run_id})", 1)
    console.print(f"wrote {out}; MLflow run {run_id} (experiment {cfg.experiment})")


from rstar2.bench import sandbox as bench_sandbox  # noqa: E402
from rstar2.bench import step_sim as bench_step  # noqa: E402
from rstar2.bench import sync as bench_sync  # noqa: E402
from rstar2.cli.models import app as models_app  # noqa: E402
from rstar2.cli.sandbox import app as sandbox_app  # noqa: E402

app.add_typer(sandbox_app, name="sandbox")
app.add_typer(models_app, name="model")
bench_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Benchmarks (rich table; --json PATH)")
app.add_typer(bench_app, name="bench")


@bench_app.callback()
def _bench_env() -> None:
    # every bench, and the workers it starts, keeps its state under RSTAR2_HOME and stays offline (no docstring:
    # it would replace the group's help)
    env.apply()


bench_app.command("sandbox")(bench_sandbox.main)
bench_app.command("sync")(bench_sync.command)
bench_app.command("step")(bench_step.command)
bench_app.command("trainer")(bench_trainer.command)  # light import: torch/TRL load in the bench's workers


@bench_app.command("rollout")
def bench_rollout(engines: int = typer.Option(64, help="engines (paper: 64)"),
                  prompts: int = typer.Option(512, help="prompts per step, 32 rollouts each (paper: 512)"),
                  seeds: int = typer.Option(10, help="workloads per scenario (the issue's bar: medians over >= 10)"),
                  scenario: list[str] = typer.Option([], help="scenario names (default: all)"),
                  rollouts: str = typer.Option("runs/*/stage*/step-*/rollouts.parquet",
                                               help="real rollout tables to measure the within-prompt correlation "
                                                    "(none match: the shipped lengths of 14,592 real rollouts)"),
                  workers: int = typer.Option(1, help="simulation processes (one scenario x seed each)"),
                  policy: list[str] = typer.Option([], help="simulated policies (default: all, oracles included)"),
                  extend: Optional[Path] = typer.Option(None, exists=True, dir_okay=False, help="an earlier --json of this command: its simulated "
                                                                   "runs are kept and summarised with the new ones"),
                  icc: Optional[float] = typer.Option(None, help="use this correlation instead of measuring it"),
                  sim: bool = typer.Option(True, help="the simulated policy comparison"),
                  real: bool = typer.Option(False, help="also a real rollout batch on vLLM engine actors"),
                  run_dir: Path = typer.Option(Path("runs/tiny"), help="real run: its SFT model and train split"),
                  model: Optional[Path] = typer.Option(None, help="real run: model dir (default: <run-dir>/sft)"),
                  real_engines: int = typer.Option(2, help="real run: vLLM engines"),
                  real_prompts: int = typer.Option(16, help="real run: prompts"),
                  real_samples: int = typer.Option(16, help="real run: rollouts per prompt (16x16: a tiny RL step's batch)"),
                  real_rounds: int = typer.Option(3, help="real run: rounds (every policy once each, order rotated); "
                                                          "figures are medians over rounds"),
                  real_kv_mb: list[int] = typer.Option([], help="real run: KV cache MiB per engine, one configuration "
                                                                "each (default: the run's, and 1/16 of it: tight)"),
                  preset: str = typer.Option("tiny", help="real run: config when <run-dir>/config.json is absent"),
                  json_path: Optional[Path] = typer.Option(None, "--json", help="write the figures here")):
    """Rollout scheduling policies in simulation (bench/rollout_sim.py, driven by rstar2/rollout/scheduler.py): makespan
    per policy vs the clairvoyant oracle, the naive work bound, GPU idle, KV recompute, per scenario; with --real,
    the same policies on live vLLM engines, and the agent loop's tokens/s vs raw vLLM generate."""
    out: dict = {}
    if real:
        out["real"] = _bench_rollout_real(preset, run_dir, model, real_engines, real_prompts, real_samples, real_rounds,
                                          real_kv_mb)
    if sim:
        out["sim"] = _bench_rollout_sim(engines, prompts, seeds, scenario, rollouts, icc, workers, policy, extend)
    _write_json(json_path, out)


def _bench_rollout_real(preset: str, run_dir: Path, model: Optional[Path], engines: int, prompts: int,
                        samples: int, rounds: int, kv_mb: list[int]) -> dict:
    import os

    from rstar2.bench import rollout_real
    from rstar2.core import config
    saved = run_dir / "config.json"  # the run's own config (its model's context length), else the preset
    cfg = config.RunCfg.model_validate_json(saved.read_text()) if saved.exists() else config.load(preset)
    cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"num_engines": engines})})
    model_dir = str(model or run_dir / "sft")
    if not Path(model_dir, "config.json").exists():
        fail(f"no model at {model_dir}: run a campaign first or pass --model")
    if rounds < 1 or any(m <= 0 for m in kv_mb):
        fail("--real-rounds and --real-kv-mb must be positive")
    kv_mb = kv_mb or [cfg.engine.kv_cache_mb, max(1, cfg.engine.kv_cache_mb // 16)]
    res = rollout_real.real_run(cfg, model_dir, rollout_real.problems_of(str(run_dir)), prompts, samples,
                                 ["kv_aware", "least_requests", "round_robin", "static"], rounds, kv_mb)
    res["load_avg_end"] = os.getloadavg()
    for c in res["configs"]:
        console.print(tables.rollout_real_table(res, c))
    return res


def _bench_rollout_sim(engines: int, prompts: int, seeds: int, scenario: list[str], rollouts: str,
                       icc: Optional[float], workers: int, policies: list[str], extend: Optional[Path]) -> dict:
    import glob

    from rstar2.core.config import SchedulerCfg
    from rstar2.bench.rollout_sim import BENCH_POLICIES, SHIPPED_LENGTHS, measured_icc, scenarios, summarize, sweep

    unknown = set(policies) - set(BENCH_POLICIES)
    if unknown:
        fail(f"unknown policy {sorted(unknown)}; choose from {', '.join(BENCH_POLICIES)}")

    measured = None
    if icc is None:
        paths = sorted(glob.glob(rollouts)) or [SHIPPED_LENGTHS]
        measured = measured_icc(paths)
        icc = measured["icc"]
        console.print(f"within-prompt length correlation (ICC) measured on {measured['rollouts']} real rollouts "
                      f"({measured['groups']} prompt groups, {', '.join(paths[:2])}{' ...' if len(paths) > 2 else ''})"
                      f": {icc:.3f}")
    grid = [s for s in scenarios(engines, prompts) if not scenario or s.name in scenario]
    if not grid:
        fail(f"no scenario named {scenario}; choose from {', '.join(s.name for s in scenarios())}")
    rows = sweep(grid, seeds, icc, SchedulerCfg(), workers,
                 on_done=lambda sc, seed: console.print(f"  {sc.name} seed {seed} done", style="dim"),
                 policies=tuple(policies) or BENCH_POLICIES)
    if extend:  # same scenarios, seeds and correlation: the simulation is deterministic given them
        try:
            old = json.loads(extend.read_text())["sim"]
        except (ValueError, KeyError, TypeError):
            fail(f"{extend} is not a --json of `rstar2 bench rollout` with simulated runs")
        if (old["engines"], old["prompts"], round(old["icc"], 6)) != (engines, prompts, round(icc, 6)):
            fail(f"{extend} was simulated with other engines/prompts/ICC")
        new = {(r["scenario"], r["seed"], r["policy"]) for r in rows}
        rows = [r for r in old["runs"] if (r["scenario"], r["seed"], r["policy"]) not in new] + rows
    summary = summarize(rows)
    table = Table(title=f"rollout scheduling, simulated: {engines} engines, {prompts}x32, ICC {icc:.3f}, "
                        f"median of {seeds} seeds")
    cols = ["scenario", "policy", "makespan_s", "x_best", "x_best_max", "x_oracle", "x_round_robin",
            "x_least_requests", "static_speedup",
            "x_naive_bound", "idle_frac", "recompute_frac", "preemptions", "queue_wait_mean_s"]
    for c in cols:
        table.add_column(c, justify="left" if c in ("scenario", "policy") else "right")
    for r in summary:
        table.add_row(*[r[c] if isinstance(r[c], str) else "-" if r[c] is None else f"{r[c]:.3g}" for c in cols])
    console.print(table)
    return {"engines": engines, "prompts": prompts, "seeds": seeds, "icc": icc, "icc_measured": measured,
            "summary": summary, "runs": rows}


if __name__ == "__main__":
    app()
