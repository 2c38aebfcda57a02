"""MLflow helpers: one experiment per campaign family, campaign run -> stage child runs -> per-step metrics.

Runs are addressed by id (MlflowClient), never through the thread-local "active run", so Prefect tasks, subflows
and retries can all log to the right run. Default store: SQLite under the run directory; MLFLOW_TRACKING_URI
points elsewhere (e.g. an `mlflow server`).
"""

from __future__ import annotations

import os
from pathlib import Path

import mlflow
from mlflow.entities import Metric, Param

_client: mlflow.MlflowClient | None = None


def setup(experiment: str, out_dir: str) -> str:
    """Point MLflow at the store and make sure the experiment exists; returns the experiment id."""
    global _client
    uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path(out_dir).resolve() / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    _client = mlflow.MlflowClient(uri)
    exp = _client.get_experiment_by_name(experiment)
    if exp is not None:
        return exp.experiment_id
    # with SQLite, artifacts would otherwise land in ./mlruns of whatever directory we run from
    return _client.create_experiment(experiment, artifact_location=(Path(out_dir) / "mlartifacts").resolve().as_uri())


def client() -> mlflow.MlflowClient:
    if _client is None:
        raise RuntimeError("tracking.setup() has not been called")
    return _client


def create_run(experiment_id: str, name: str, parent_id: str | None = None, tags: dict | None = None) -> str:
    tags = {**(tags or {}), **({"mlflow.parentRunId": parent_id} if parent_id else {})}
    return client().create_run(experiment_id, run_name=name, tags=tags).info.run_id


def flatten(tree: dict, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = str(v)[:500]
    return out


def log_params(run_id: str, params: dict) -> None:
    items = [Param(k, v) for k, v in flatten(params).items()]
    for i in range(0, len(items), 100):
        client().log_batch(run_id, params=items[i:i + 100])


def log_metrics(run_id: str, metrics: dict, step: int, prefix: str = "") -> None:
    import time

    ts = int(time.time() * 1000)
    items = [Metric(f"{prefix}{k}", float(v), ts, step) for k, v in metrics.items()
             if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if items:
        client().log_batch(run_id, metrics=items)


def end(run_id: str, status: str = "FINISHED") -> None:
    client().set_terminated(run_id, status)
