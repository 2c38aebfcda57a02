"""Prefect artifacts off the step's path. An artifact (a step's progress, its sampled trajectories) is for people
watching the UI, and nothing in the run reads it back, so the step need not wait for the API call: `later` hands the
call to one thread, which makes the calls in the order they were handed over while the step goes on, and `drain`
waits for them (a stage's end; the interpreter waits for the thread at exit as well). Each call runs in a copy of
the caller's context, so Prefect files the artifact under the task or flow run that made it. A call that fails is
logged and lost: it never fails the run."""

from __future__ import annotations

import contextvars
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

from rstar2.tasks import costs

_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rstar2-artifacts")
_PENDING: set[Future] = set()
_LOCK = threading.Lock()
_log = logging.getLogger(__name__)


def later(call: Callable, *args, **kwargs) -> Future:
    """`call(*args, **kwargs)` on the artifact thread, after every call handed over before it."""
    ctx = contextvars.copy_context()
    fut = _POOL.submit(ctx.run, _run, call, args, kwargs)
    with _LOCK:
        _PENDING.add(fut)
    fut.add_done_callback(_forget)
    return fut


def drain(timeout_s: float = 60.0) -> int:
    """Wait (at most `timeout_s`) for the calls handed over so far; returns how many were still running after it."""
    with _LOCK:
        pending = set(_PENDING)
    return len(wait(pending, timeout=timeout_s).not_done) if pending else 0


def _run(call: Callable, args: tuple, kwargs: dict):
    try:
        with costs.prefect():  # an API call: counted as Prefect's, though the step did not wait for it
            return call(*args, **kwargs)
    except Exception as e:  # a lost artifact is a lost picture, never a lost run
        _log.warning("artifact call %s failed: %s: %s", getattr(call, "__name__", call), type(e).__name__, e)
        return None


def _forget(fut: Future) -> None:
    with _LOCK:
        _PENDING.discard(fut)

