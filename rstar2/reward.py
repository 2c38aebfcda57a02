"""Outcome reward, paper §2.2.1 Eq. 3: r = 1 if the answer in `\\boxed{}` inside `<answer>` is equivalent to
the ground truth (rule-based Math-Verify), else 0. No format reward, no tool-error penalty (paper §2.2.3).

Unlike the released code (last `\\boxed{}` anywhere, PRIME heuristics first: notes §5, §10 row 6) we follow
the paper: a stray `\\boxed{}` in a later `<reason>` block cannot decide the reward. Math-Verify enforces its
timeouts with `signal.alarm`, so it runs only in a process's main thread: `Verifier` uses a spawned process
pool (safe to create from a threaded trainer) and a per-item deadline, so a pathological answer that hangs
in C code costs that item 0.0 and a pool restart, never a stalled training step.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, BrokenExecutor, ProcessPoolExecutor, wait
from typing import Callable

from rstar2.template import ANSWER_CLOSE, ANSWER_OPEN

log = logging.getLogger(__name__)
_BOXED = "\\boxed{"


def _last_boxed(text: str) -> str | None:
    """Content of the last top-level, brace-balanced `\\boxed{...}` (`\\{`, `\\}` are literal braces)."""
    found, i = None, 0
    while (start := text.find(_BOXED, i)) >= 0:
        depth, j = 1, start + len(_BOXED)
        while j < len(text) and depth:
            if text[j] == "\\":
                j += 1
            elif text[j] in "{}":
                depth += 1 if text[j] == "{" else -1
            j += 1
        if depth:  # unbalanced: nothing after it can close either
            break
        found, i = text[start + len(_BOXED):j - 1], j
    return found


def extract_answer(response_text: str) -> str | None:
    """The last `\\boxed{}` of the last closed `<answer> ... </answer>` block; None if there is none."""
    close = response_text.rfind(ANSWER_CLOSE)
    start = response_text.rfind(ANSWER_OPEN, 0, close) if close >= 0 else -1
    if start < 0:
        return None
    return _last_boxed(response_text[start + len(ANSWER_OPEN):close])


def verify_one(pred: str | None, gold: str, timeout_s: float) -> float:
    """1.0 if `pred` is mathematically equivalent to `gold` per Math-Verify, else 0.0 (errors, timeouts)."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("verify_one needs a main thread (Math-Verify uses signal.alarm): use Verifier")
    if pred is None:
        return 0.0
    from math_verify import parse, verify

    t = max(1, math.ceil(timeout_s))  # Math-Verify takes whole seconds
    try:
        gold_parsed = parse(f"${gold}$", parsing_timeout=t) or parse(f"\\boxed{{{gold}}}", parsing_timeout=t)
        pred_parsed = parse(f"\\boxed{{{pred}}}", parsing_timeout=t)
        return 1.0 if gold_parsed and pred_parsed and verify(gold_parsed, pred_parsed, timeout_seconds=t) else 0.0
    except Exception:
        return 0.0


def _init_worker() -> None:
    import math_verify  # noqa: F401  (pay the sympy import once per worker, not in the first item's deadline)


class Verifier:
    """Scores batches in worker processes. At most `workers` items are in flight, so each one's deadline
    starts when it really starts; a hung item scores 0.0, the pool is killed and the other in-flight items
    are re-run on a fresh one. `fn` is the per-item check (swappable for tests or other checkers)."""

    STARTUP_GRACE_S = 60.0  # extra time for items sent to a pool whose workers are still importing

    def __init__(self, workers: int = 1, timeout_s: float = 2.0, *, item_deadline_s: float | None = None,
                 fn: Callable[[str, str, float], float] = verify_one):
        self.workers, self.timeout_s, self._fn = workers, timeout_s, fn
        # parse(gold) + parse(pred) + verify, each under Math-Verify's own whole-second timeout, plus slack
        self.item_deadline_s = item_deadline_s or 3 * max(1, math.ceil(timeout_s)) + 2.0
        self._pool: ProcessPoolExecutor | None = None
        self._warm = False
        self.restarts = 0

    def _kill_pool(self) -> None:
        if self._pool is None:
            return
        procs = list(getattr(self._pool, "_processes", {}).values())  # no public terminate before 3.14
        self._pool.shutdown(wait=False, cancel_futures=True)
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        self._pool, self._warm = None, False
        self.restarts += 1

    def score(self, responses: list[str], golds: list[str], truncated: list[bool]) -> list[float]:
        """Binary rewards in input order; truncated responses and responses without an answer get 0.0."""
        if not len(responses) == len(golds) == len(truncated):
            raise ValueError("responses, golds and truncated must have the same length")
        scores = [0.0] * len(responses)
        todo = deque((i, pred, gold) for i, (resp, gold, cut) in enumerate(zip(responses, golds, truncated))
                     if not cut and (pred := extract_answer(resp)) is not None)
        running: dict = {}  # future -> (index, pred, gold, deadline)
        while todo or running:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(self.workers, mp_context=mp.get_context("spawn"),
                                                 initializer=_init_worker)
            while todo and len(running) < self.workers:
                i, pred, gold = todo.popleft()
                deadline = time.monotonic() + self.item_deadline_s + (0 if self._warm else self.STARTUP_GRACE_S)
                running[self._pool.submit(self._fn, pred, gold, self.timeout_s)] = (i, pred, gold, deadline)
            nearest = min(d for *_, d in running.values())
            done, _ = wait(running, timeout=max(0.0, nearest - time.monotonic()), return_when=FIRST_COMPLETED)
            failed = []
            for fut in done:
                i = running.pop(fut)[0]
                try:
                    scores[i], self._warm = float(fut.result()), True
                except Exception as e:  # a worker died (BrokenProcessPool) or the checker raised
                    log.warning("verification of item %d failed (%r): scored 0.0", i, e)
                    failed.append(e)
            hung = [f for f, (*_, d) in running.items() if time.monotonic() >= d]
            for fut in hung:
                i, pred = running.pop(fut)[:2]
                log.warning("verification of item %d (answer %.80r) hung: scored 0.0, restarting pool", i, pred)
            if hung or any(isinstance(e, BrokenExecutor) for e in failed):
                todo.extendleft((i, p, g) for i, p, g, _ in running.values())  # innocent: run them again
                running.clear()
                self._kill_pool()
        return scores

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> Verifier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
