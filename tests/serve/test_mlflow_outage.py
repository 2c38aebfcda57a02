"""The MLflow tracking server stopped in the middle of a run, then started again (`rstar2 serve`'s server, real, on a
free 127.0.0.1 port): a step's metrics logged meanwhile wait (the MLflow client retries with backoff for ~4 minutes:
MLFLOW_HTTP_REQUEST_MAX_RETRIES 7, factor 2) and land once the server is back, each step exactly once."""

import os
import signal
import threading
import time

import mlflow
import pytest

from rstar2.cli import services
from rstar2.run import tracking
from tests.ports import free_port

pytestmark = pytest.mark.e2e
OUTAGE_S = 15  # past the client's first retries (0, 4 and 12 s after the first try); the 60 s case only waits longer


def _stop(proc) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=30)


def test_metrics_logged_while_mlflow_is_down_land_once_it_is_back(tmp_path, monkeypatch):
    port, store = free_port(), tmp_path / "store"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    server = services.start_mlflow(port, store, tmp_path / "mlflow.log")
    try:
        exp = tracking.setup("outage", str(tmp_path / "runs"))
        run = tracking.create_run(exp, "stage-stage1")
        tracking.log_metrics(run, {"reward_mean": 0.25}, 1)
        _stop(server)
        logged = threading.Event()
        t0 = time.monotonic()
        writer = threading.Thread(target=lambda: (tracking.log_metrics(run, {"reward_mean": 0.5}, 2), logged.set()),
                                  daemon=True)
        writer.start()
        time.sleep(OUTAGE_S)
        assert not logged.is_set()  # it waited for the server instead of failing or dropping the step
        server = services.start_mlflow(port, store, tmp_path / "mlflow.log")
        writer.join(timeout=180)
        assert logged.is_set(), "the step's metrics were not logged after the server came back"
        took = time.monotonic() - t0
        tracking.log_metrics(run, {"reward_mean": 0.75}, 3)
        history = mlflow.MlflowClient(f"http://127.0.0.1:{port}").get_metric_history(run, "reward_mean")
        assert sorted((m.step, m.value) for m in history) == [(1, 0.25), (2, 0.5), (3, 0.75)], history
        assert took >= OUTAGE_S
    finally:
        _stop(server)
