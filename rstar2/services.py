"""`rstar2 serve`: the local services a user lives with, all on 127.0.0.1 — a Prefect server (UI on :4200), an MLflow
server (UI on :5000) over the shared store of `runs/`, the deployments of prefect.yaml registered on a process work
pool, and a worker that runs what is triggered from the UI, scheduled, or fired by a committed-checkpoint event.

Everything goes through the `prefect` / `mlflow` command lines (this module imports neither), and every tool's state
stays under RSTAR2_HOME."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
POOL = "rstar2-local"


def _bin(name: str) -> str:
    here = Path(sys.executable).parent / name  # the venv's own CLI, even when the venv is not activated
    return str(here) if here.exists() else (shutil.which(name) or name)


def wait_http(url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status < 500:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not answer within {timeout_s:.0f} s")
        time.sleep(1.0)


def start_prefect(port: int, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen([_bin("prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                            stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)
    wait_http(f"http://127.0.0.1:{port}/api/health")
    return proc


def start_mlflow(port: int, out_dir: Path, log: Path) -> subprocess.Popen:
    out_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([_bin("mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
                             "--backend-store-uri", f"sqlite:///{out_dir / 'mlflow.db'}",
                             "--default-artifact-root", (out_dir / "mlartifacts").as_uri()],
                            stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)
    wait_http(f"http://127.0.0.1:{port}/health")
    return proc


def register_deployments(env: dict) -> None:
    """The work pool and every deployment of prefect.yaml (schedules and event triggers included)."""
    subprocess.run([_bin("prefect"), "work-pool", "create", POOL, "--type", "process", "--overwrite"], env=env,
                   cwd=ROOT, check=True, capture_output=True)
    done = subprocess.run([_bin("prefect"), "--no-prompt", "deploy", "--all"], env=env, cwd=ROOT, capture_output=True,
                          text=True)
    if done.returncode:
        raise RuntimeError(f"prefect deploy failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def serve(prefect_port: int, mlflow_port: int, out_dir: Path, worker: bool = True,
          say: Callable[[str], None] = print) -> None:
    home = Path(os.environ["RSTAR2_HOME"])
    env = {**os.environ, "PREFECT_API_URL": f"http://127.0.0.1:{prefect_port}/api",
           "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{mlflow_port}", "RSTAR2_ROOT": str(ROOT),
           "RSTAR2_MLFLOW_UI": f"http://127.0.0.1:{mlflow_port}"}
    procs = [start_prefect(prefect_port, home / "prefect-server.log")]
    try:
        procs.append(start_mlflow(mlflow_port, out_dir, home / "mlflow-server.log"))
        register_deployments(env)
        say(f"Prefect UI  http://127.0.0.1:{prefect_port}   (export PREFECT_API_URL={env['PREFECT_API_URL']})")
        say(f"MLflow UI   http://127.0.0.1:{mlflow_port}   (export MLFLOW_TRACKING_URI={env['MLFLOW_TRACKING_URI']})")
        say(f"deployments of prefect.yaml registered on work pool {POOL!r}")
        say("Ctrl-C stops everything")
        if worker:
            subprocess.run([_bin("prefect"), "worker", "start", "--pool", POOL, "--limit", "1"], env=env, cwd=ROOT)
        else:
            procs[0].wait()
    except KeyboardInterrupt:
        pass
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)
