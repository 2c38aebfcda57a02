"""HTTP front-end of one SandboxService (FastAPI): `rstar2 sandbox serve --host 127.0.0.1 --port N`.

POST /run           {code, stdin?, timeout_s?}              -> result
POST /run/batch     {"requests": [{code, stdin?, timeout_s?}]} -> {"results": [...]} (input order)
GET  /metrics       Prometheus text (calls by status, latency/queue histograms, queue depth, isolation layers)
GET  /metrics/snapshot  the same as JSON counters (clients summarise an interval from two of them)
GET  /health        isolation report, slots, queue depth

Backpressure: a batch is admitted call by call; while the queue is full the handler waits (asynchronously) up to
`admission_timeout_s`, then answers 503 with Retry-After, which the batching client retries.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import FastAPI, HTTPException
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field

from rstar2.sandbox.api import ExecRequest, QueueFull
from rstar2.sandbox.service import SandboxService

MAX_BATCH = 4096


class RunRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    code: str
    stdin: str = ""
    timeout_s: float | None = Field(None, gt=0, le=3600)


class BatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    requests: list[RunRequest] = Field(max_length=MAX_BATCH)


async def _admit(service: SandboxService, req: RunRequest, deadline: float) -> asyncio.Future:
    item = ExecRequest(req.code, req.stdin, req.timeout_s)
    while True:
        try:
            return asyncio.wrap_future(service.submit(item, block=False))
        except QueueFull:
            if time.monotonic() > deadline:
                raise HTTPException(503, "sandbox queue full", headers={"Retry-After": "1"})
            await asyncio.sleep(0.005)


def create_app(service: SandboxService, admission_timeout_s: float = 5.0) -> FastAPI:
    app = FastAPI(title="rstar2 sandbox", version="1")

    @app.post("/run")
    async def run(req: RunRequest) -> dict:
        fut = await _admit(service, req, time.monotonic() + admission_timeout_s)
        return (await fut).to_dict()

    @app.post("/run/batch")
    async def run_batch(batch: BatchRequest) -> dict:
        deadline = time.monotonic() + admission_timeout_s
        futs = [await _admit(service, r, deadline) for r in batch.requests]
        return {"results": [r.to_dict() for r in await asyncio.gather(*futs)]}

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(service.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/metrics/snapshot")
    def snapshot() -> dict:
        return service.snapshot()

    @app.get("/health")
    def health() -> dict:
        return {"ok": True, "slots": service.slots, "queue_depth": service.queue_depth,
                "isolation": service.isolation()}

    return app


def serve(service: SandboxService, host: str, port: int) -> None:
    """Serve until interrupted (uvicorn, one process: the service's own slots are its parallelism)."""
    import uvicorn

    uvicorn.run(create_app(service), host=host, port=port, log_level="warning", access_log=False)
