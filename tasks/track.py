"""MLflow writes as tasks, so each is a node of its flow's graph (retried, timed and logged like the rest). Runs are
addressed by id (rstar2.core.tracking); a retried flow finds its runs again by key and keeps logging into them. A
step's health line (INFO) and collapse alert (WARNING) go to the `rstar2.tasks.track` logger: the terminal and the
flow run's Prefect logs."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from prefect import task
from prefect.artifacts import create_link_artifact
from pydantic import BaseModel

from rstar2.core import tracking
from rstar2.evaluation import health
from rstar2.tasks import costs

log = logging.getLogger(__name__)


class RunSpec(BaseModel):
    """An MLflow run to open: the run keyed `key` in `experiment` (created with `tags` and under `parent_id` if new);
    `set_tags` and `params` are (re)written each time, and `link_key` names a link artifact to the run in the MLflow
    UI."""
    experiment: str
    out_dir: str
    name: str
    key: str
    parent_id: str | None = None
    tags: dict = {}
    set_tags: dict = {}
    params: dict = {}
    link_key: str | None = None


@task(name="open-run", cache_policy=None)
@costs.work
def open_run(spec: RunSpec) -> tuple[str, str]:
    """Returns (experiment id, run id)."""
    with costs.mlflow():
        exp_id = tracking.setup(spec.experiment, spec.out_dir)
        run_id = tracking.find_or_create_run(exp_id, spec.name, spec.key, spec.parent_id, spec.tags or None)
        for k, v in spec.set_tags.items():
            tracking.client().set_tag(run_id, k, str(v))
        if spec.params:
            tracking.log_params(run_id, spec.params)
    if spec.link_key:
        with costs.prefect():
            create_link_artifact(tracking.ui_url(exp_id, run_id), link_text=f"MLflow: {spec.name}",
                                 key=spec.link_key)
    return exp_id, run_id


@task(name="log-metrics", cache_policy=None)
@costs.work
def log_metrics(run_id: str, metrics: dict, step: int) -> None:
    with costs.mlflow():
        tracking.log_metrics(run_id, metrics, step)


@task(name="log-record", cache_policy=None)
@costs.work
def log_record(run_id: str, record: dict, artifact: str, tags: dict | None = None) -> None:
    """A JSON record as a run artifact (e.g. a stage's end, a transition), with tags that summarize it."""
    with costs.mlflow():
        tracking.client().log_dict(run_id, record, artifact)
        for k, v in (tags or {}).items():
            tracking.client().set_tag(run_id, k, str(v))


@task(name="log-dataset", cache_policy=None)
@costs.work
def log_dataset(run_id: str, uri: str, name: str, context: str, lineage: dict) -> None:
    """A Parquet table (e.g. a mined hard set) as a run input, with its lineage."""
    with costs.mlflow():
        tracking.log_dataset(run_id, uri, name, context, lineage)


@task(name="end-run", cache_policy=None)
@costs.work
def end_run(run_id: str, status: str = "FINISHED") -> None:
    with costs.mlflow():
        tracking.end(run_id, status)


@contextmanager
def ending(run_id: str, owns_run: bool = True) -> Iterator[None]:
    """The block is the MLflow run's life: it ends FINISHED when the block does, FAILED on any exception (re-raised).
    `owns_run` off: the run outlives the block (another flow ends it)."""
    try:
        yield
    except BaseException:
        if owns_run:
            end_run(run_id, "FAILED")
        raise
    if owns_run:
        end_run(run_id)


def _step_writes(rows: list[dict], global_step0: int, stage: str) -> tuple[int, dict, dict, dict]:
    """The last of `rows` as written: its global step, the campaign run's headline figures, the stage run's metrics
    and the collapse tags; logs its health line and, if it fired, the collapse alert."""
    row, step = rows[-1], global_step0 + rows[-1]["step"]
    fired = health.collapse_alert(rows)
    log.info("[%s] %s", stage, health.health_line(row, step))
    if fired:
        log.warning("[%s] ALERT collapse at step %d: %s", stage, step, "; ".join(fired))
    tags = {}
    if first := health.first_collapse(rows):
        i, what = first
        tags = {"alert.collapse": f"step {global_step0 + rows[i]['step']}: {'; '.join(what)}",
                "alert.collapse_step": global_step0 + rows[i]["step"]}
    headline = {k: row[k] for k in ("reward_mean", "tool_error_rate_pos") if k in row}
    metrics = {k: v for k, v in row.items() if k != "step" and not k.startswith("eval_")}
    return step, headline, {**metrics, "collapse_alert": float(fired is not None)}, tags


@task(name="log-step", cache_policy=None)
def log_step(rows: list[dict], global_step0: int, stage: str, runs: tuple[str, str],
             since: tuple[float, dict]) -> tuple[dict, tuple[float, dict]]:
    """One RL step in the logs and in MLflow, one write per run. Logs: the health line, and the collapse alert
    (rstar2/evaluation/health.py) over the stage's history `rows` (per-step metrics, oldest first, rebuilt from the
    committed checkpoints on a resumed run). Stage run: the step's metrics (evaluation figures are logged with their
    checkpoint), collapse_alert 0/1, what orchestration cost the step (tasks/costs.py) and, once the alert fired, the
    tags alert.collapse / alert.collapse_step naming the first step that fired (recomputed from the whole history each
    time, so a resumed run sets the same ones). Campaign run: the headline figures. The step's window runs from `since`
    (costs.mark()) to just before the stage run's write, which therefore counts in the next step's; returns the step's
    cost figures and that mark. Orchestration itself: no work."""
    run_id, parent_run_id = runs  # the stage's MLflow run and the campaign's (or the seed's)
    step, headline, metrics, tags = _step_writes(rows, global_step0, stage)
    with costs.mlflow():
        tracking.log_metrics(parent_run_id, headline, step)
    end = costs.mark()
    cost = costs.overhead(since, end)
    with costs.mlflow():
        tracking.log_metrics(run_id, {**metrics, **cost}, step, tags=tags)
    return cost, end


@task(name="log-unlogged-steps", cache_policy=None)
@costs.work
def log_unlogged_steps(rows: list[dict], global_step0: int, stage: str, runs: tuple[str, str]) -> list[int]:
    """The committed steps of a resumed stage (`rows`, from their checkpoints' manifests) that MLflow never got,
    logged now as `log_step` would have (without the orchestration cost, which died with the process): the process
    died between a checkpoint's commit and its step's write. Each step is then in MLflow exactly once. Returns their
    global steps."""
    run_id, parent_run_id = runs
    with costs.mlflow():
        logged = {m.step for m in tracking.client().get_metric_history(run_id, "reward_mean")}
    done = []
    for i, row in enumerate(rows):
        if global_step0 + row["step"] in logged:
            continue
        step, headline, metrics, tags = _step_writes(rows[:i + 1], global_step0, stage)
        with costs.mlflow():
            tracking.log_metrics(parent_run_id, headline, step)
            tracking.log_metrics(run_id, metrics, step, tags=tags)
        done.append(step)
    return done
