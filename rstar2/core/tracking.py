"""MLflow helpers: one experiment per campaign family, campaign run -> stage child runs -> per-step metrics.

Runs are addressed by id (MlflowClient), never through the thread-local "active run", so Prefect tasks, subflows
and retries can all log to the right run. Default store: SQLite under the run directory; MLFLOW_TRACKING_URI
points elsewhere (e.g. an `mlflow server`).
"""

from __future__ import annotations

import os
from pathlib import Path

import mlflow
from mlflow.entities import Metric, Param, RunTag

_client: mlflow.MlflowClient | None = None
EXPERIMENT_KIND = "mlflow.experimentKind"


def store_uri(out_dir: str) -> str:
    """MLFLOW_TRACKING_URI, else one SQLite store for every run under `out_dir`, so the UI compares them all."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path(out_dir).resolve() / 'mlflow.db'}"


def setup(experiment: str, out_dir: str) -> str:
    """Point MLflow at the store and make sure the experiment exists; returns the experiment id."""
    global _client
    uri = store_uri(out_dir)
    user_uri = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    # set_tracking_uri also exports MLFLOW_TRACKING_URI; left there, the next campaign in this process (or a child
    # process) would log to this run's store instead of its own out_dir
    if user_uri is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    _client = mlflow.MlflowClient(uri)
    exp = _client.get_experiment_by_name(experiment)
    if exp is not None:
        return exp.experiment_id
    # with SQLite, artifacts would otherwise land in ./mlruns of whatever directory we run from; a tracking server
    # picks the location itself (`mlflow server --serve-artifacts`: uploaded to it, never onto this machine's disk).
    # The kind tag makes the MLflow 3 UI open on the runs table (model training) instead of its GenAI traces overview
    local = not uri.startswith(("http://", "https://"))
    return _client.create_experiment(experiment, artifact_location=(Path(out_dir) / "mlartifacts").resolve().as_uri()
                                     if local else None, tags={EXPERIMENT_KIND: "custom_model_development"})


def client() -> mlflow.MlflowClient:
    if _client is None:
        raise RuntimeError("tracking.setup() has not been called")
    return _client


def create_run(experiment_id: str, name: str, parent_id: str | None = None, tags: dict | None = None) -> str:
    tags = {**(tags or {}), **({"mlflow.parentRunId": parent_id} if parent_id else {})}
    return client().create_run(experiment_id, run_name=name, tags=tags).info.run_id


def find_or_create_run(experiment_id: str, name: str, key: str, parent_id: str | None = None,
                       tags: dict | None = None) -> str:
    """The run tagged `rstar2.key=key` (a retried flow keeps logging into it, so no step shows up twice), or a new
    one. `key` names what the run tracks, e.g. the run directory, or the run directory plus a stage."""
    found = client().search_runs([experiment_id], f"tags.`rstar2.key` = '{key}'", max_results=1)
    if found:
        run_id = found[0].info.run_id
        client().update_run(run_id, status="RUNNING")
        return run_id
    return create_run(experiment_id, name, parent_id, {**(tags or {}), "rstar2.key": key})


def ui_url(experiment_id: str, run_id: str) -> str:
    """Where the run is in the MLflow UI (the server `rstar2 serve` starts, unless MLFLOW_TRACKING_URI is a server)."""
    uri = client().tracking_uri
    base = uri.rstrip("/") if uri.startswith("http") else os.environ.get("RSTAR2_MLFLOW_UI", "http://127.0.0.1:5000")
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}?workflowType=machine_learning"


def checkpoint_model(experiment_id: str, run_id: str, ckpt_dir: str, meta: dict) -> str:
    """One LoggedModel per committed checkpoint (found again by its path), its lineage as params; returns its id."""
    path = str(Path(ckpt_dir).resolve())
    found = client().search_logged_models([experiment_id], f"tags.`rstar2.core.checkpoint` = '{path}'", max_results=1)
    if found:
        return found[0].model_id
    name = "-".join(str(meta.get(k)) for k in ("stage", "step") if meta.get(k) is not None) or Path(path).name
    model = client().create_logged_model(experiment_id, name=name.replace("/", "-"), source_run_id=run_id,
                                         tags={"rstar2.core.checkpoint": path}, params=flatten(meta))
    client().finalize_logged_model(model.model_id, "READY")
    return model.model_id


def log_model_metrics(run_id: str, model_id: str, metrics: dict, step: int) -> None:
    """Metrics attached both to the run and to the checkpoint's LoggedModel (what the Models tab compares)."""
    import time

    ts = int(time.time() * 1000)
    items = [Metric(k, float(v), ts, step, model_id=model_id, run_id=run_id)
             for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if items:
        client().log_batch(run_id, metrics=items)


def log_table(run_id: str, rows: list[dict], artifact: str) -> None:
    """Rows of one table as a run artifact that the MLflow UI shows as a table (Artifacts, Evaluation). Written once:
    MLflow appends the rows to an existing table, so a retried flow would repeat them."""
    import pandas as pd

    folder = str(Path(artifact).parent) if Path(artifact).parent != Path(".") else None
    if any(f.path == artifact for f in client().list_artifacts(run_id, folder)):
        return
    client().log_table(run_id, pd.DataFrame(rows), artifact)


def log_dataset(run_id: str, uri: str, name: str, context: str, lineage: dict) -> None:
    """Record a Parquet table (e.g. a mined hard set) as a run input, with its lineage as a JSON artifact."""
    import mlflow.data
    import polars as pl

    ds = mlflow.data.from_pandas(pl.read_parquet(uri).to_pandas(), source=uri, name=name)
    tags = [mlflow.entities.InputTag("mlflow.data.context", context)]
    client().log_inputs(run_id, [mlflow.entities.DatasetInput(ds._to_mlflow_entity(), tags)])
    client().log_dict(run_id, lineage, f"datasets/{name}.json")


def stage_histories(experiment_id: str, campaign_run_id: str, metrics: list[str]) -> dict[str, list[tuple[int, float]]]:
    """Per-step curves of a campaign: each metric's (global step, value) over all its stage child runs."""
    by_stage = histories_by_stage(experiment_id, campaign_run_id, metrics)
    return {m: sorted(point for curves in by_stage.values() for point in curves[m]) for m in metrics}


def histories_by_stage(experiment_id: str, campaign_run_id: str,
                       metrics: list[str]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """Per-step curves of a campaign, one set per stage child run (keyed by run name), for one line per stage."""
    stages = client().search_runs([experiment_id], f"tags.mlflow.parentRunId = '{campaign_run_id}'",
                                  order_by=["attributes.start_time ASC"])
    return {r.info.run_name: {m: sorted((h.step, h.value) for h in client().get_metric_history(r.info.run_id, m))
                              for m in metrics} for r in stages}


def flatten(tree: dict, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = str(v)[:500]
    return out


class ChangedParams(ValueError):
    """A run resumed (found by its key) with settings other than those it was started with."""


def log_params(run_id: str, params: dict) -> None:
    """The run's settings, once: a run found again (a retry, the same command again) must have the same ones, else one
    error naming what changed (MLflow keeps a run's params fixed)."""
    flat = flatten(params)
    logged = client().get_run(run_id).data.params
    changed = {k: (logged[k], str(v)) for k, v in flat.items() if k in logged and logged[k] != str(v)}
    if changed:
        what = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in sorted(changed.items())[:6])
        raise ChangedParams(f"MLflow run {run_id} ({client().get_run(run_id).data.tags.get('rstar2.key')}) was started "
                            f"with other settings ({what}{', ...' if len(changed) > 6 else ''}): resume it with its "
                            "own, or start a new run (another run name, or delete the run directory and this MLflow "
                            "run)")
    items = [Param(k, v) for k, v in flat.items() if k not in logged]
    for i in range(0, len(items), 100):
        client().log_batch(run_id, params=items[i:i + 100])


def log_metrics(run_id: str, metrics: dict, step: int, prefix: str = "", tags: dict | None = None) -> None:
    """The numeric `metrics` at `step` and `tags` on the run, in one write."""
    import time

    ts = int(time.time() * 1000)
    items = [Metric(f"{prefix}{k}", float(v), ts, step) for k, v in metrics.items()
             if isinstance(v, (int, float)) and not isinstance(v, bool)]
    run_tags = [RunTag(k, str(v)) for k, v in (tags or {}).items()]
    if items or run_tags:
        client().log_batch(run_id, metrics=items, tags=run_tags)


def end(run_id: str, status: str = "FINISHED") -> None:
    client().set_terminated(run_id, status)
