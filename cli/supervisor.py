"""What `rstar2 serve` runs (the command: cli/services.py): the local services a user lives with, all on 127.0.0.1 —
a Prefect server (UI on :4200), an MLflow server (UI on :5000) over the shared store of `runs/`, the deployments of
prefect.yaml registered on a process work pool, and a worker that runs what is triggered from the UI, scheduled, or
fired by a committed-checkpoint event; each server started again when it exits, and all of it stopped as a tree.

The servers and the worker are the `prefect` / `mlflow` command lines; what `serve` asks of the Prefect server goes
through Prefect's client, imported when it is first needed (it takes seconds to load). Every tool's state stays under
RSTAR2_HOME."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Callable

import psutil

PROJECT = Path(__file__).resolve().parent.parent  # the checkout holding prefect.yaml and the flows it deploys
POOL = "rstar2-local"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
WORKER_GRACE_S = 30.0  # a running flow gets this long after SIGTERM to commit or be marked crashed/cancelled
SERVER_GRACE_S = 15.0
SERVER_RESTARTS = 3  # a server that exits is started again on its port and state, up to this many times in all


class PortInUse(RuntimeError):
    """A port `serve` needs is held by another process (named in the message)."""


class Stop(BaseException):
    """Raised in `serve` by SIGINT/SIGTERM/SIGHUP (a BaseException, so no `except Exception` swallows it)."""


def port_holder(port: int) -> str | None:
    """Who listens on 127.0.0.1/0.0.0.0 `port` ("pid 123 (prefect server ...)"), or None when it is free."""
    for c in psutil.net_connections(kind="inet"):
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port:
            if c.pid is None:
                return "a process of another user"
            try:
                proc = psutil.Process(c.pid)
                return f"pid {c.pid} ({' '.join(proc.cmdline())[:120] or proc.name()})"
            except psutil.Error:
                return f"pid {c.pid}"
    return None


def check_ports(**ports: int) -> None:
    """One clear error naming the process that holds a port `serve` needs."""
    for what, port in ports.items():
        holder = port_holder(port)
        if holder:
            raise PortInUse(f"port {port} ({what}) is already in use by {holder}; stop it or pick another "
                               f"port (--{what.replace('_', '-')})")


def stop_tree(procs: list[psutil.Process], grace_s: float) -> None:
    """SIGTERM `procs` (a process and its descendants, listed before any of them dies so none is missed), wait up
    to `grace_s`, then SIGKILL whatever is left."""
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)


def tree(proc: subprocess.Popen) -> list[psutil.Process]:
    try:
        root = psutil.Process(proc.pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _bin(name: str) -> str:
    here = Path(sys.executable).parent / name  # the venv's own CLI, even when the venv is not activated
    return str(here) if here.exists() else (shutil.which(name) or name)


def _wait(answers: Callable[[], bool], what: str, timeout_s: float) -> None:
    """Until `answers()` (asked once a second), at most `timeout_s`; then TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout_s
    while not answers():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not answer within {timeout_s:.0f} s")
        time.sleep(1.0)


def wait_http(url: str, timeout_s: float = 120.0) -> None:
    """Until `url` answers a GET with anything but a server error (MLflow's and the sandbox's health)."""
    def answers() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                return r.status < 500
        except OSError:
            return False

    _wait(answers, url, timeout_s)


def prefect_client(api_url: str):
    """Prefect's client of the server at `api_url` (its /api URL), whatever PREFECT_API_URL this process has."""
    from prefect.client.orchestration import SyncPrefectClient

    return SyncPrefectClient(api_url)


def wait_prefect(api_url: str, timeout_s: float = 120.0) -> None:
    """Until the Prefect server at `api_url` answers its health check."""
    def answers() -> bool:
        with prefect_client(api_url) as client:
            return client.api_healthcheck() is None

    _wait(answers, api_url, timeout_s)


def start_prefect(port: int, log: Path, started: list | None = None, env: dict | None = None) -> subprocess.Popen:
    """The Prefect server, answering; `started` gets the process before the wait, so a stop meanwhile finds it. `env`:
    variables over this process's (e.g. a PREFECT_HOME of its own)."""
    proc = subprocess.Popen([_bin("prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                            stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **(env or {})})
    (started if started is not None else []).append(proc)
    wait_prefect(f"http://127.0.0.1:{port}/api")
    return proc


# MLflow's server job runner (GenAI scorer jobs, which no run submits) would start seven consumer processes
MLFLOW_SERVER_ENV = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


def start_mlflow(port: int, out_dir: Path, log: Path, started: list | None = None) -> subprocess.Popen:
    out_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([_bin("mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
                             "--backend-store-uri", f"sqlite:///{out_dir / 'mlflow.db'}",
                             "--default-artifact-root", (out_dir / "mlartifacts").as_uri()],
                            env={**os.environ, **MLFLOW_SERVER_ENV}, stdout=log.open("ab"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    (started if started is not None else []).append(proc)
    wait_http(f"http://127.0.0.1:{port}/health")
    return proc


def crash_orphaned_runs(api_url: str, reason: str) -> list[str]:
    """Mark Crashed the flow runs of our work pool that the API still shows as running or pending once the worker is
    gone (a flow killed mid-step cannot report its own end). A crashed run is final, so the UI's Retry resumes it from
    its last committed checkpoint; left Running, it would look alive forever. Returns the ids marked."""
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
        WorkPoolFilter,
        WorkPoolFilterName,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    unfinished = FlowRunFilterStateType(any_=[StateType.RUNNING, StateType.PENDING, StateType.CANCELLING])
    with prefect_client(api_url) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=unfinished)),
                                     work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[POOL])))
        for run in runs:
            client.set_flow_run_state(run.id, Crashed(message=reason), force=True)
    return [str(run.id) for run in runs]


def register_deployments(env: dict) -> None:
    """The work pool and every deployment of prefect.yaml (schedules and event triggers included)."""
    subprocess.run([_bin("prefect"), "work-pool", "create", POOL, "--type", "process", "--overwrite"], env=env,
                   cwd=PROJECT, check=True, capture_output=True)
    done = subprocess.run([_bin("prefect"), "--no-prompt", "deploy", "--all"], env=env, cwd=PROJECT,
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"prefect deploy failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def _supervise(running: dict[str, subprocess.Popen], starts: dict[str, Callable[[], subprocess.Popen]],
               work: subprocess.Popen | None, say: Callable[[str], None]) -> bool:
    """Watch the services; a server that exits is started again (what is left of its process group killed first,
    so nothing holds its port), up to SERVER_RESTARTS in all. Returns True when the worker exited, False when the
    servers used up their restarts."""
    restarts = 0
    while work is None or work.poll() is None:
        for name, proc in running.items():
            if proc.poll() is None:
                continue
            if restarts == SERVER_RESTARTS:
                return False
            restarts += 1
            say(f"the {name} exited (code {proc.returncode}); starting it again ({restarts} of {SERVER_RESTARTS})")
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: the group outlives a killed leader
            except ProcessLookupError:
                pass
            running[name] = starts[name]()
            say(f"the {name} answers again")
        time.sleep(0.5)
    return True


def _crash_orphans(api_url: str, why: str, say: Callable[[str], None]) -> None:
    import httpx  # Prefect's client's errors; loaded with the client

    try:
        ids = crash_orphaned_runs(api_url, f"rstar2 serve stopped ({why}) while this run ran; retry resumes it from "
                                           "its last committed checkpoint")
    except (OSError, httpx.HTTPError) as e:  # the Prefect server is gone: nothing to mark, the servers stop next
        say(f"could not mark interrupted runs crashed: {e}")
        return
    for run_id in ids:
        say(f"flow run {run_id} was still running: marked Crashed (retry resumes it)")


def serve(prefect_port: int, mlflow_port: int, out_dir: Path, worker: bool = True,
          say: Callable[[str], None] = print, worker_grace_s: float = WORKER_GRACE_S) -> None:
    """Run the services until SIGINT/SIGTERM/SIGHUP, the worker exits, or the servers have exited more than
    SERVER_RESTARTS times; then stop the worker first (a running flow gets `worker_grace_s` to finish its step or be
    marked crashed, and is retryable from its last checkpoint), then the servers. A server that exits is started again
    on its port over its own state (Prefect's database, MLflow's store), so the worker and a running flow, whose clients
    retry, go on as if it had not. Every process started here runs in its own session and is stopped with all its
    descendants."""
    check_ports(prefect_port=prefect_port, mlflow_port=mlflow_port)
    home = Path(os.environ["RSTAR2_HOME"])
    env = {**os.environ, "PREFECT_API_URL": f"http://127.0.0.1:{prefect_port}/api",
           "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{mlflow_port}", "RSTAR2_ROOT": str(PROJECT),
           "RSTAR2_MLFLOW_UI": f"http://127.0.0.1:{mlflow_port}"}

    def on_signal(signum, _frame):
        raise Stop(signal.Signals(signum).name)

    previous = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}
    servers: list[subprocess.Popen] = []
    work: subprocess.Popen | None = None
    stopped_by = "a service exited"
    starts = {"Prefect server": lambda: start_prefect(prefect_port, home / "prefect-server.log", servers),
              "MLflow server": lambda: start_mlflow(mlflow_port, out_dir, home / "mlflow-server.log", servers)}
    try:
        running = {name: start() for name, start in starts.items()}
        register_deployments(env)
        say(f"Prefect UI  http://127.0.0.1:{prefect_port}   (export PREFECT_API_URL={env['PREFECT_API_URL']})")
        say(f"MLflow UI   http://127.0.0.1:{mlflow_port}   (export MLFLOW_TRACKING_URI={env['MLFLOW_TRACKING_URI']})")
        say(f"deployments of prefect.yaml registered on work pool {POOL!r}")
        say("Ctrl-C (or SIGTERM/SIGHUP) stops everything")
        if worker:
            work = subprocess.Popen([_bin("prefect"), "worker", "start", "--pool", POOL, "--limit", "1"], env=env,
                                    cwd=PROJECT, start_new_session=True)
        if _supervise(running, starts, work, say):
            say("the worker exited; stopping the servers")
        else:
            say(f"the servers exited more than {SERVER_RESTARTS} times; stopping everything")
    except Stop as e:
        stopped_by = f"{e}"
        say(f"{e}: stopping the worker, then the servers")
    finally:
        for s in STOP_SIGNALS:  # the shutdown is bounded; a second Ctrl-C must not cut it short and leak processes
            signal.signal(s, signal.SIG_IGN)
        try:
            if work is not None:
                stop_tree(tree(work), worker_grace_s)
                _crash_orphans(env["PREFECT_API_URL"], stopped_by, say)
            stop_tree([p for s in reversed(servers) for p in tree(s)], SERVER_GRACE_S)
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
