"""`rstar2 sandbox ...`: run the service over HTTP, show what isolation this machine gives."""

from __future__ import annotations

import json
import logging
from typing import Optional

import typer

from rstar2.bench.sandbox import isolation_table
from rstar2.core import progress
from rstar2.sandbox.api import SandboxLimits

app = typer.Typer(add_completion=False, no_args_is_help=True, help="The code-execution sandbox service")
console = progress.console()


def _service(slots: int, limits: SandboxLimits, require: list[str], prewarm: list[str]):
    from rstar2.sandbox.service import SandboxService

    try:
        return SandboxService(limits, slots=slots, require=require, prewarm=prewarm)
    except (ValueError, RuntimeError) as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2)


@app.command()
def serve(host: str = typer.Option("127.0.0.1", help="address to bind"),
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
        console.print(f"[red]error:[/red] --limits: {e}")
        raise typer.Exit(2)
    service = _service(slots, limits, require, prewarm)
    console.print(isolation_table(service.isolation()))
    console.print(f"sandbox service on http://{host}:{port} ({slots} slots)")
    try:
        serve_http(service, host, port)
    finally:
        service.close()


@app.command()
def check(json_path: Optional[str] = typer.Option(None, "--json", help="write the report here")):
    """Start a service, print which isolation layers are active on this machine, and stop."""
    import json
    from pathlib import Path

    service = _service(1, SandboxLimits(), [], [])
    layers = service.isolation()
    service.close()
    console.print(isolation_table(layers))
    if json_path:
        Path(json_path).write_text(json.dumps(layers, indent=1))
