"""What every flow that drives engines enters first: `run_context` builds the world, opens the run's MLflow run and
creates its Controller (rstar2/controller.py), and on the way out stops the actors and, for the run's own flow,
closes the MLflow run FINISHED or FAILED. The flow starts the actors (tasks.rl.start_actors) once it knows the model
they load, and passes `ctx.ctl` to its subflows and tasks."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rstar2.config import RunCfg
from rstar2.controller import Controller
from tasks import track
from tasks.world import build_world


@dataclass(frozen=True)
class RunContext:
    cfg: RunCfg
    run: Path  # the run directory
    world: dict[str, str]  # the world's URIs (tasks.world.build_world)
    experiment_id: str
    mlflow_run_id: str  # the campaign's run (the one keyed by the run directory)
    ctl: Controller


@contextmanager
def run_context(cfg: RunCfg, run: Path, controller_id: str, tags: dict, world_dir: Path | None = None,
                owns_run: bool = False, with_world: bool = True, **open_run) -> Iterator[RunContext]:
    """`controller_id`: the Controller's run id, i.e. its actors' name prefix (a flow that may run beside the
    campaign, such as a triggered evaluation, takes one of its own). `tags`: the MLflow run's tags if it is new; `open_run`: more of
    tasks.track.open_run's options. `owns_run`: this flow is the run's campaign, so it ends the MLflow run. `with_world` off: no world is built (its URIs are {}), for a flow that
    needs none (evaluating a given model on eval.suites)."""
    exp_id, run_id = track.open_run(cfg.experiment, cfg.out_dir, run.name, str(run), tags=tags, **open_run)
    ctl = Controller(controller_id)
    try:
        with track.ending(run_id, owns_run):
            world = build_world(cfg, str(world_dir or run / "world")) if with_world else {}
            yield RunContext(cfg, run, world, exp_id, run_id, ctl)
    finally:
        ctl.stop()
