"""`rstar2 campaign|chaos|plan|check|ablation|presets|config`: a run before, during and after it (its plan, its
preflight checks, the campaign and ablation flows, the chaos matrix). The flows, Prefect and torch load inside the
commands that use them, so `rstar2 --help` starts in well under a second."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import typer

from rstar2.cli import env, tables
from rstar2.cli.output import console, write_json
from rstar2.cli.refuse import check_preset, fail
from rstar2.core import config
from rstar2.core.checkpoint import DiskFull
from rstar2.rollout.stream_check import StreamMismatch
from rstar2.run import ablations


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
    check_preset(preset, set_)
    from rstar2.flows.campaign import CampaignParams
    from rstar2.flows.campaign import campaign as campaign_flow

    params = CampaignParams(preset=preset, overrides=set_, run_name=run_name, sft_checkpoint=sft_checkpoint,
                            seeds=seeds)
    if world_seeds > 1:
        from rstar2.flows.campaign_worlds import campaign_worlds

        if sft_checkpoint:
            fail("--world-seeds trains one SFT model per world; drop --sft-checkpoint")
        summary = _stopped(lambda: campaign_worlds(params, world_seeds))
        console.print(tables.worlds_table(summary, preset))
        console.print(f"wall time {summary['wall_s']:.0f} s; run dirs {', '.join(summary['world_run_dirs'].values())}")
        write_json(json_path, summary)
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
    write_json(json_path, summary)


def _stopped(run_flow: Callable[[], dict]) -> dict:
    """A campaign flow's summary; a run the preflight refused (or its tracking: a run resumed with other settings), or
    one a run-stopping check stopped, ends the command with that check's one line (under Prefect's log of it),
    anything else with its traceback."""
    from rstar2.core.tracking import ChangedParams  # MLflow, torch: loaded when the command runs
    from rstar2.run.preflight import PreflightError

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
    from rstar2.core.fingerprint import WeightSyncError  # torch: loaded once a run has stopped
    from rstar2.training.trainer import LogprobGapError

    seen = _in_chain(e, (DiskFull, LogprobGapError, StreamMismatch, WeightSyncError))
    return seen and (getattr(seen, "cause", None) or seen)  # a RayTaskError(DiskFull) holds the DiskFull as its cause


def chaos(preset: str = typer.Option("tiny", help="preset name or YAML path"),
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
    from rstar2.cli.chaos import runner

    env.apply()
    check_preset(preset, set_)
    try:
        report = runner.run_chaos(preset, set_, row or runner.DEFAULT_ROWS, outage_s, sft_checkpoint,
                                  say=console.print)
    except (ValueError, RuntimeError) as e:
        fail(e)
    console.print(tables.chaos_table(report))
    write_json(json_path, report)
    if not report["all_recovered"]:
        raise typer.Exit(1)


def plan(preset: str = typer.Option("tiny", help="preset name or YAML path"),
         gpus: Optional[int] = typer.Option(None, min=0, help="accelerators (default: the preset's placement.gpus; "
                                                               "0: this machine's RAM)"),
         gpu_mem: Optional[float] = typer.Option(None, "--gpu-mem", min=1, help="GB of one accelerator "
                                                 "(default: the preset's placement.gpu_mem_gb)"),
         set_: list[str] = typer.Option([], "--set", help="override, e.g. --set trainer.world_size=16"),
         json_path: Optional[Path] = typer.Option(None, "--json", help="write the figures here")):
    """Whether a preset fits its hardware: per-device memory of trainer ranks and engines, and a verdict. Exit code 1
    when it does not fit (a campaign refuses such a run before any actor starts)."""
    from rstar2.run import plan as fit

    try:
        res = fit.plan(config.load(preset, set_), gpus, gpu_mem)
    except Exception as e:  # noqa: BLE001 - shown to the user as one line
        fail(e)
    for table in tables.plan_tables(res, preset):
        console.print(table)
    console.print("[green]fits[/green]" if res["fits"] else "[red]does not fit[/red]")
    write_json(json_path, res)
    if not res["fits"]:
        raise typer.Exit(1)


def check(preset: str = typer.Option("tiny", help="preset name or YAML path"),
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
    from rstar2.run import preflight, runstate

    try:
        cfg = config.load(preset, set_)
    except Exception as e:  # noqa: BLE001 - shown to the user as one line
        fail(e)
    res = preflight.run(cfg, runstate.layout(cfg, run_name), sft_checkpoint)
    console.print(tables.check_table(res, preset))
    warned = sum(c["status"] == preflight.WARN for c in res["checks"])
    console.print(f"[green]ready[/green] ({warned} warning(s))" if res["ok"] else "[red]cannot start[/red]")
    write_json(json_path, res)
    if not res["ok"]:
        raise typer.Exit(1)


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
    check_preset(preset, set_)
    chosen = [v.strip() for v in variants.split(",") if v.strip()]
    if sft_checkpoint and (world_seeds or 1) > 1:
        fail("--world-seeds trains one SFT model per world; drop --sft-checkpoint")
    try:
        [ablations.overrides(v) for v in chosen]
        from rstar2.flows.ablation import AblationParams
        from rstar2.flows.ablation import ablation as ablation_flow
        params = AblationParams(preset=preset, variants=chosen, overrides=set_, name=name,
                                sft_checkpoint=sft_checkpoint, seeds=seeds, world_seeds=world_seeds,
                                last_steps=last_steps)
    except ValueError as e:  # pydantic's ValidationError is one
        fail(e)
    res = ablation_flow(params)
    for t in tables.ablation_tables(res, name, preset):
        console.print(t)
    console.print(tables.ablation_steps_table(res))
    for line in tables.ablation_conclusions(res):
        console.print(line)
    console.print(f"plots: {res['plots']} (also in MLflow, run {res['mlflow_run_id']})")
    write_json(json_path, res)


def presets():
    """List the available presets."""
    for name in config.list_presets():
        console.print(name)


def show_config(preset: str = "tiny", set_: list[str] = typer.Option([], "--set")):
    """Print the resolved config of a preset (with overrides)."""
    try:
        console.print_json(config.load(preset, set_).model_dump_json())
    except Exception as e:  # noqa: BLE001
        fail(e)
