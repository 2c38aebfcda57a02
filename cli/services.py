"""`rstar2 serve` (the local Prefect and MLflow servers and a worker; their processes: cli/supervisor.py) and
`rstar2 sandbox ...` (the sandbox service over HTTP, and what isolation this machine gives). Light to import: the
sandbox's container image runs `rstar2 sandbox serve` with the service's packages alone (no psutil, Prefect or
MLflow)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

import typer

from rstar2.bench.sandbox import isolation_table
from rstar2.cli import env
from rstar2.cli.output import console
from rstar2.cli.refuse import fail
from rstar2.sandbox.api import SandboxLimits


def serve(prefect_port: int = 4200, mlflow_port: int = 5000,
          out_dir: Path = typer.Option(Path("runs"), help="where runs and the shared MLflow store live"),
          worker: bool = typer.Option(True, help="also run a worker for the deployments' runs")):
    """Local services on 127.0.0.1: Prefect server, MLflow server, and a runner serving prefect.yaml's deployments."""
    env.apply()
    from rstar2.cli import supervisor  # psutil: not in the sandbox's image, which runs the commands below

    try:
        supervisor.serve(prefect_port, mlflow_port, out_dir.resolve(), worker, console.print)
    except supervisor.PortInUse as e:
        fail(e)


sandbox_app = typer.Typer(add_completion=False, no_args_is_help=True, help="The code-execution sandbox service")


def _service(slots: int, limits: SandboxLimits, require: list[str], prewarm: list[str]):
    from rstar2.sandbox.service import SandboxService

    try:
        return SandboxService(limits, slots=slots, require=require, prewarm=prewarm)
    except (ValueError, RuntimeError) as e:
        fail(e)


@sandbox_app.command("serve")
def sandbox_serve(host: str = typer.Option("127.0.0.1", help="address to bind"),
                  port: int = typer.Option(8000, help="port to bind"),
                  slots: int = typer.Option(4, help="executor slots (calls at once); 2 per core is the sweet spot"),
                  timeout_s: float = typer.Option(4.0, help="wall-clock limit per call"),
                  memory_mb: int = typer.Option(512, help="memory per call beyond the warm interpreter"),
                  require: list[str] = typer.Option([], help="isolation layer that must be active (repeatable)"),
                  prewarm: list[str] = typer.Option(["bare", "sci"], help="executor profiles to start up front"),
                  limits_json: Optional[str] = typer.Option(None, "--limits", help="every limit as a JSON object of "
                                                      "SandboxLimits fields (replaces --timeout-s and --memory-mb)")):
    """Serve the sandbox over HTTP: POST /run, POST /run/batch, GET /metrics (Prometheus), GET /health."""
    from rstar2.sandbox.server import serve as serve_http

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        limits = (SandboxLimits(**json.loads(limits_json)) if limits_json
                  else SandboxLimits(timeout_s=timeout_s, memory_mb=memory_mb))
    except (ValueError, TypeError) as e:
        fail(f"--limits: {e}")
    service = _service(slots, limits, require, prewarm)
    console.print(isolation_table(service.isolation()))
    console.print(f"sandbox service on http://{host}:{port} ({slots} slots)")
    try:
        serve_http(service, host, port)
    finally:
        service.close()


@sandbox_app.command("check")
def sandbox_check(json_path: Optional[str] = typer.Option(None, "--json", help="write the report here")):
    """Start a service, print which isolation layers are active on this machine, and stop."""
    service = _service(1, SandboxLimits(), [], [])
    layers = service.isolation()
    service.close()
    console.print(isolation_table(layers))
    if json_path:
        Path(json_path).write_text(json.dumps(layers, indent=1))
