"""The servers a row of `rstar2 chaos` runs beside its campaign (rstar2.cli.chaos): MLflow, Prefect and the
sandbox's HTTP server, each on a free port of this machine with its own state, so a fault can stop one (and it is
started again after its outage) without touching anything but that row."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from rstar2.cli import supervisor
from rstar2.cli.chaos.faults import Run
from rstar2.core.net import free_port
from rstar2.sandbox.backends import limits_of


@dataclass
class Server:
    """A server a row runs beside its campaign (MLflow, the sandbox's HTTP server, Prefect): a fault stops it, and it
    is started again `down_for` seconds later, as a supervisor would, in a thread of its own (the faults after it
    keep their moments while it starts)."""
    start: Callable[[], subprocess.Popen]
    proc: subprocess.Popen | None = None
    down_at: float | None = None
    down_for: float = 0.0
    starting: threading.Thread | None = None

    def up(self) -> None:
        self.proc, self.down_at = self.start(), None

    def kill(self, sig: signal.Signals, down_for: float) -> None:
        os.killpg(self.proc.pid, sig)
        self.proc.wait(timeout=60)
        self.down_at, self.down_for = time.monotonic(), down_for

    def due(self) -> bool:
        return self.down_at is not None and self.starting is None and time.monotonic() - self.down_at >= self.down_for

    def up_soon(self) -> None:
        self.starting = threading.Thread(target=self.up, daemon=True)
        self.starting.start()

    def wait_up(self) -> None:
        """Up now: the start under way finished, or a start now."""
        if self.starting is not None:
            self.starting.join()
            self.starting = None
        if self.down_at is not None:
            self.up()

    def stop(self) -> None:
        if self.starting is not None:
            self.starting.join()
        if self.proc is not None and self.down_at is None:
            supervisor.stop_tree(supervisor.tree(self.proc), grace_s=30)


def servers_up(run: Run, due_only: bool = False) -> None:
    """Start again the row's servers a fault stopped: those whose time is up, in the background (`due_only`), or all,
    waiting until they answer."""
    for server in run.state.get("servers", {}).values():
        if due_only:
            if server.due():
                server.up_soon()
        else:
            server.wait_up()


def start_sandbox_server(sandbox, port: int, log: Path) -> subprocess.Popen:
    """`rstar2 sandbox serve` on 127.0.0.1:`port` with the run's limits and slots (`sandbox`: its SandboxCfg)."""
    proc = subprocess.Popen([sys.executable, "-m", "rstar2.cli.main", "sandbox", "serve", "--port", str(port),
                             "--slots", str(sandbox.workers), "--limits", json.dumps(asdict(limits_of(sandbox)))],
                            stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)
    supervisor.wait_http(f"http://127.0.0.1:{port}/health")
    return proc


def start_row_servers(run: Run, faults: list[str], out: Path, sandbox, uri: str, sets: list[str]
                      ) -> tuple[str, list[str]]:
    """The servers the row's faults stop, started (kept in `run.state["servers"]`, their settings in the campaign's
    environment or overrides); returns the row's tracking URI and overrides (`uri` and `sets` when it has none)."""
    name, row_uri, row_sets = run.layout.name, uri, list(sets)
    if "mlflow" in faults:  # this row tracks to a server of its own, which the fault stops and starts again
        port, store = free_port(), out / f"{name}-mlflow"
        server = run.state["servers"]["mlflow"] = Server(
            lambda: supervisor.start_mlflow(port, store, out / f"{name}-mlflow.log"))
        server.up()
        row_uri = run.env["MLFLOW_TRACKING_URI"] = f"http://127.0.0.1:{port}"
    if "prefect" in faults:  # the row's flows report to a Prefect server of its own (its own database)
        port_p, home = free_port(), out / f"{name}-prefect"
        server = run.state["servers"]["prefect"] = Server(lambda: supervisor.start_prefect(
            port_p, out / f"{name}-prefect.log", env={"PREFECT_HOME": str(home)}))
        server.up()
        run.env["PREFECT_API_URL"] = f"http://127.0.0.1:{port_p}/api"
    if "server" in faults:  # the row's code runs on a sandbox server of its own, with the run's limits
        port_s = free_port()
        server = run.state["servers"]["sandbox"] = Server(
            lambda: start_sandbox_server(sandbox, port_s, out / f"{name}-sandbox.log"))
        server.up()
        row_sets += ["sandbox.backend=http", f"sandbox.urls=[http://127.0.0.1:{port_s}]"]
    return row_uri, row_sets
