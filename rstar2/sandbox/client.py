"""The paper's "send workers" (§3.1; the released code's `RequestProcessor`): callers put requests
on one asyncio queue; `senders` coroutines each wait for a first request, take whatever else is queued (up to
`batch_size`, without waiting) and send it as one batch over a transport (HTTP servers, or Ray actors), waiting for
the results before the next batch. Transient failures (connection errors, 5xx, queue full, a dead actor) are retried
with exponential back-off, only after a failure (the released client sleeps even after a success); after `retries`
attempts the callers get `SandboxUnavailable`. A batch retried after a timeout may run twice on the server (code
runs in a sandbox, so that is harmless); each caller gets exactly one result.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Future

from rstar2.sandbox.api import ExecRequest, ExecResult, SandboxUnavailable
from rstar2.sandbox.metrics import merge

log = logging.getLogger(__name__)


class TransientError(Exception):
    """A failure worth retrying (the request may or may not have run)."""


class HttpTransport:
    """POSTs batches to `/run/batch` of one or more servers, round robin."""

    def __init__(self, urls: list[str], timeout_s: float = 600.0, connections: int = 16):
        if not urls:
            raise ValueError("HttpTransport needs at least one server URL")
        self.urls = [u.rstrip("/") for u in urls]
        self._next = itertools.cycle(range(len(self.urls)))
        self._timeout_s, self._connections = timeout_s, connections
        self._session = None

    async def _client(self):
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self._timeout_s),
                                                  connector=aiohttp.TCPConnector(limit=self._connections))
        return self._session

    async def send(self, batch: list[dict]) -> list[dict]:
        import aiohttp

        url = self.urls[next(self._next)]
        session = await self._client()
        try:
            async with session.post(f"{url}/run/batch", json={"requests": batch}) as resp:
                if resp.status in (429, 502, 503, 504):
                    raise TransientError(f"{url}: HTTP {resp.status}")
                if resp.status != 200:
                    raise ValueError(f"{url} refused the batch: HTTP {resp.status}: {(await resp.text())[:500]}")
                return (await resp.json())["results"]
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
            raise TransientError(f"{url}: {e!r}") from e

    async def snapshot(self) -> dict:
        session = await self._client()
        snaps = []
        for url in self.urls:
            async with session.get(f"{url}/metrics/snapshot") as resp:
                snaps.append(await resp.json())
        return merge(snaps)

    async def isolation(self) -> dict:
        session = await self._client()
        async with session.get(f"{self.urls[0]}/health") as resp:
            return (await resp.json())["isolation"]

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class BatchingClient:
    def __init__(self, transport, batch_size: int = 64, senders: int = 8, retries: int = 4,
                 backoff_s: float = 0.1):
        if batch_size < 1 or senders < 1 or retries < 1:
            raise ValueError("batch_size, senders and retries must be positive")
        self.transport = transport
        self.batch_size, self.senders, self.retries, self.backoff_s = batch_size, senders, retries, backoff_s
        self._queue: asyncio.Queue | None = None
        self._tasks: list[asyncio.Task] = []

    def _ensure_started(self) -> None:
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._tasks = [asyncio.create_task(self._sender()) for _ in range(self.senders)]

    async def run(self, req: ExecRequest) -> ExecResult:
        req.validate()
        self._ensure_started()
        fut = asyncio.get_running_loop().create_future()
        await self._queue.put(({"code": req.code, "stdin": req.stdin, "timeout_s": req.timeout_s}, fut))
        return ExecResult.from_dict(await fut)

    async def run_batch(self, reqs: list[ExecRequest]) -> list[ExecResult]:
        return list(await asyncio.gather(*(self.run(r) for r in reqs)))

    async def _sender(self) -> None:
        while True:
            items = [await self._queue.get()]
            while len(items) < self.batch_size and not self._queue.empty():
                items.append(self._queue.get_nowait())
            items = [(body, fut) for body, fut in items if not fut.cancelled()]
            if not items:
                continue
            try:
                results = await self._send_with_retries([body for body, _ in items])
            except Exception as e:  # noqa: BLE001 - handed to each waiting caller
                for _, fut in items:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            for (_, fut), res in zip(items, results):
                if not fut.done():
                    fut.set_result(res)

    async def _send_with_retries(self, batch: list[dict]) -> list[dict]:
        for attempt in range(self.retries):
            try:
                results = await self.transport.send(batch)
                if len(results) != len(batch):
                    raise TransientError(f"{len(results)} results for a batch of {len(batch)}")
                return results
            except TransientError as e:
                if attempt == self.retries - 1:
                    raise SandboxUnavailable(f"sandbox unreachable after {self.retries} attempts: {e}") from e
                delay = self.backoff_s * 2 ** attempt
                log.warning("sandbox batch of %d failed (%s): retrying in %.2f s", len(batch), e, delay)
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks, self._queue = [], None
        await self.transport.close()


class SyncSandbox:
    """A BatchingClient on a private event loop thread, with the interface of the in-process service: `submit` (a
    future, the rollout's tool calls; cancelling it drops a call not yet sent), `run`, `run_batch` (blocking), plus
    the service's metrics snapshot and isolation report. `on_close` releases what the backend started (a container,
    actors)."""

    def __init__(self, client: BatchingClient, on_close: Callable[[], None] | None = None):
        self.client, self._on_close = client, on_close
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sandbox-client", daemon=True)
        self._thread.start()

    def _call(self, coro: Awaitable):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def submit(self, req: ExecRequest) -> Future:
        """One call; the future resolves to its ExecResult."""
        return asyncio.run_coroutine_threadsafe(self.client.run(req), self._loop)

    def run(self, req: ExecRequest) -> ExecResult:
        return self._call(self.client.run(req))

    def run_batch(self, reqs: list[ExecRequest]) -> list[ExecResult]:
        return self._call(self.client.run_batch(reqs)) if reqs else []

    def snapshot(self) -> dict:
        return self._call(self.client.transport.snapshot())

    def isolation(self) -> dict:
        return self._call(self.client.transport.isolation())

    def close(self) -> None:
        if self._thread.is_alive():
            self._call(self.client.aclose())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()
        if self._on_close is not None:
            self._on_close()
            self._on_close = None

    def __enter__(self) -> SyncSandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
