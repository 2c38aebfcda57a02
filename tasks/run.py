"""What every flow that drives engines enters first: `run_context` builds the world, opens the run's MLflow run and
creates its Controller (rstar2/run/controller.py), and on the way out stops the actors and, for the run's own flow,
closes the MLflow run FINISHED or FAILED. It yields the run's reference (rstar2.core.layout.RunRef), the one run-level
value flows and tasks pass on; `controller` finds the run's Controller from it. The flow starts the actors
(rstar2.tasks.rl.start_actors) once it knows the model they load."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rstar2.core.config import RunCfg
from rstar2.core.layout import RunLayout, RunRef, WorldPaths
from rstar2.run.controller import Controller
from rstar2.tasks import track
from rstar2.tasks.world import build_world

# the Controllers of the runs this driver process has open, by controller id: actor handles cannot travel as task
# parameters, so tasks look them up from the run reference they are given
_OPEN: dict[str, Controller] = {}


def controller(run: RunRef) -> Controller:
    ctl = _OPEN.get(run.controller_id)
    if ctl is None:
        raise RuntimeError(f"no open run with controller {run.controller_id!r} in this process: a task that drives "
                           "engines runs inside the flow that opened its run (rstar2.tasks.run.run_context)")
    return ctl


@contextmanager
def run_context(cfg: RunCfg, layout: RunLayout, controller_id: str, tags: dict, owns_run: bool = False,
                with_world: bool = True, **open_run) -> Iterator[RunRef]:
    """`controller_id`: the Controller's run id, i.e. its actors' name prefix (a flow that may run beside the
    campaign, such as a triggered evaluation, takes one of its own). `tags`: the MLflow run's tags if it is new;
    `open_run`: more of rstar2.tasks.track.RunSpec's fields. `owns_run`: this flow is the run's campaign, so it ends the
    MLflow run. `with_world` off: no world is built, for a flow that needs none (evaluating a given model on
    eval.suites)."""
    if controller_id in _OPEN:
        raise RuntimeError(f"controller {controller_id!r} is already open in this process")
    exp_id, run_id = track.open_run(track.RunSpec(experiment=cfg.experiment, out_dir=cfg.out_dir, name=layout.root.name,
                                                  key=str(layout.root), tags=tags, **open_run))
    _OPEN[controller_id] = Controller(controller_id)
    try:
        with track.ending(run_id, owns_run):
            world = WorldPaths(**build_world(cfg, str(layout.world))) if with_world else None
            yield RunRef(layout=layout, world=world, experiment_id=exp_id, mlflow_run_id=run_id,
                         controller_id=controller_id)
    finally:
        _OPEN.pop(controller_id).stop()
