"""`rstar2 bench ...`: the benchmarks, each a command of its bench/ module (sandbox, sync, step, trainer) or, for
`rollout`, a thin command over bench/rollout_sim.py and bench/rollout_real.py whose tables are cli/bench_tables.py.
Every bench, and the workers it starts, keeps its state under RSTAR2_HOME and stays offline."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from rstar2.bench import sandbox as bench_sandbox
from rstar2.bench import step_sim as bench_step
from rstar2.bench import sync as bench_sync
from rstar2.bench import trainer as bench_trainer  # light: torch and TRL load in the bench's workers
from rstar2.cli import bench_tables, env
from rstar2.cli.output import console, write_json
from rstar2.cli.refuse import fail
from rstar2.core.layout import ROLLOUTS, RunLayout

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Benchmarks (rich table; --json PATH)")


@app.callback()
def _bench_env() -> None:
    # every bench, and the workers it starts, keeps its state under RSTAR2_HOME and stays offline (no docstring:
    # it would replace the group's help)
    env.apply()


app.command("sandbox")(bench_sandbox.main)
app.command("sync")(bench_sync.command)
app.command("step")(bench_step.command)
app.command("trainer")(bench_trainer.command)


@app.command("rollout")
def rollout(engines: int = typer.Option(64, help="engines (paper: 64)"),
            prompts: int = typer.Option(512, help="prompts per step, 32 rollouts each (paper: 512)"),
            seeds: int = typer.Option(10, help="workloads per scenario (the issue's bar: medians over >= 10)"),
            scenario: list[str] = typer.Option([], help="scenario names (default: all)"),
            rollouts: str = typer.Option(RunLayout.step_tables_pattern("runs", ROLLOUTS),
                                         help="real rollout tables to measure the within-prompt correlation "
                                              "(none match: the shipped lengths of 14,592 real rollouts)"),
            workers: int = typer.Option(1, help="simulation processes (one scenario x seed each)"),
            policy: list[str] = typer.Option([], help="simulated policies (default: all, oracles included)"),
            extend: Optional[Path] = typer.Option(None, exists=True, dir_okay=False,
                                                  help="an earlier --json of this command: its simulated "
                                                       "runs are kept and summarised with the new ones"),
            icc: Optional[float] = typer.Option(None, help="use this correlation instead of measuring it"),
            sim: bool = typer.Option(True, help="the simulated policy comparison"),
            real: bool = typer.Option(False, help="also a real rollout batch on vLLM engine actors"),
            run_dir: Path = typer.Option(Path("runs/tiny"), help="real run: its SFT model and train split"),
            model: Optional[Path] = typer.Option(None, help="real run: model dir (default: <run-dir>/sft)"),
            real_engines: int = typer.Option(2, help="real run: vLLM engines"),
            real_prompts: int = typer.Option(16, help="real run: prompts"),
            real_samples: int = typer.Option(16, help="real run: rollouts per prompt (16x16: a tiny RL step's "
                                                      "batch)"),
            real_rounds: int = typer.Option(3, help="real run: rounds (every policy once each, order rotated); "
                                                    "figures are medians over rounds"),
            real_kv_mb: list[int] = typer.Option([], help="real run: KV cache MiB per engine, one configuration "
                                                          "each (default: the run's, and 1/16 of it: tight)"),
            preset: str = typer.Option("tiny", help="real run: config when <run-dir>/config.json is absent"),
            json_path: Optional[Path] = typer.Option(None, "--json", help="write the figures here")):
    """Rollout scheduling policies in simulation (bench/rollout_sim.py, driven by rstar2/rollout/scheduler.py): makespan
    per policy vs the clairvoyant oracle, the naive work bound, GPU idle, KV recompute, per scenario; with --real,
    the same policies on live vLLM engines, and the agent loop's tokens/s vs raw vLLM generate."""
    from rstar2.bench import rollout_sim  # numpy: loaded when the bench runs

    out: dict = {}
    try:
        if real:
            from rstar2.bench import rollout_real  # Ray and vLLM: only for the real run

            out["real"] = rollout_real.measure(preset, run_dir, model, real_engines, real_prompts, real_samples,
                                               real_rounds, real_kv_mb)
            for c in out["real"]["configs"]:
                console.print(bench_tables.rollout_real_table(out["real"], c))
        if sim:
            out["sim"] = rollout_sim.compare(engines, prompts, seeds, scenario, rollouts, icc, workers, policy, extend,
                                             say=console.print)
            console.print(bench_tables.rollout_sim_table(out["sim"]))
    except ValueError as e:
        fail(e)
    write_json(json_path, out)
