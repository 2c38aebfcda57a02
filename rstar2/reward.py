"""Outcome reward, paper §2.2.1 Eq. 3: r = 1 if the answer in `\\boxed{}` inside `<answer>` is equivalent to
the ground truth (rule-based Math-Verify), else 0. No format reward, no tool-error penalty (paper §2.2.3).

Unlike the released code (last `\\boxed{}` anywhere, PRIME heuristics first) we follow
the paper: a stray `\\boxed{}` in a later `<reason>` block cannot decide the reward. As in the paper (§3.1) and the
released code, the check runs in the code-execution service, under its own wall-clock timeout: a
pathological answer that hangs Math-Verify (even in C code, where its `signal.alarm` cannot interrupt) costs that
item 0.0 and one killed sandbox child, never a stalled training step.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import threading
from collections import Counter

from rstar2.data.answers import last_boxed
from rstar2.rollout.template import ANSWER_CLOSE, ANSWER_OPEN
from rstar2.sandbox import OK, ExecRequest

log = logging.getLogger(__name__)


def extract_answer(response_text: str) -> str | None:
    """The last `\\boxed{}` of the last closed `<answer> ... </answer>` block; None if there is none."""
    close = response_text.rfind(ANSWER_CLOSE)
    start = response_text.rfind(ANSWER_OPEN, 0, close) if close >= 0 else -1
    if start < 0:
        return None
    return last_boxed(response_text[start + len(ANSWER_OPEN):close])


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


VERIFY_CODE = "import json, math, sys, threading\n" + inspect.getsource(verify_one) + """
items = json.loads(sys.stdin.read())
print(json.dumps([verify_one(i["pred"], i["gold"], i["timeout_s"]) for i in items]))
"""  # runs in the sandbox ("verify" executor: math-verify preloaded); the items as JSON on stdin


def _scores(res, n: int) -> list[float] | None:
    """The n scores a check call printed, or None if it failed or printed something else."""
    if res.status != OK:
        return None
    try:
        scores = [float(x) for x in json.loads(res.stdout)]
    except (ValueError, TypeError):
        return None
    return scores if len(scores) == n else None


class Verifier:
    """Scores batches through a sandbox backend (anything with `run_batch`). Answers are checked `chunk` to a
    sandbox call (each call pays a fork and math-verify's first-parse page copies, ~15 ms; an item alone ~1 ms),
    each item under Math-Verify's own timeout and the call under a wall-clock limit of `timeout_s`. A call that
    does not finish in time (an answer that hangs even where SIGALRM cannot interrupt it) is redone item by item,
    each alone under `timeout_s`: the hanging one scores 0.0, the others are not penalised. `code` is the checking
    program (reads a JSON list of {"pred", "gold", "timeout_s"} on stdin, prints the list of scores)."""

    def __init__(self, sandbox, timeout_s: float = 2.0, chunk: int = 32, code: str = VERIFY_CODE):
        if chunk < 1 or timeout_s <= 0:
            raise ValueError("chunk and timeout_s must be positive")
        self.sandbox, self.timeout_s, self.chunk, self.code = sandbox, timeout_s, chunk, code
        self.last_statuses: Counter = Counter()  # per item of the last batch: how its (last) check ended

    def _run(self, groups: list[list[tuple[int, str, str]]]) -> list[list[float] | None]:
        reqs = [ExecRequest(self.code, json.dumps([{"pred": p, "gold": g, "timeout_s": self.timeout_s}
                                                   for _, p, g in items]), timeout_s=self.timeout_s)
                for items in groups]
        out = []
        for items, res in zip(groups, self.sandbox.run_batch(reqs) if reqs else []):
            scores = _scores(res, len(items))
            if scores is not None:
                self.last_statuses[OK] += len(items)
            elif len(items) == 1:  # a failed chunk is not counted: its items are redone one by one
                self.last_statuses[res.status if res.status != OK else "error"] += 1
                log.warning("verification of item %d (answer %.80r) ended %s: scored 0.0 (%s)", items[0][0],
                            items[0][1], res.status, res.stderr.strip()[-200:])
            out.append(scores)
        return out

    def score(self, responses: list[str], golds: list[str], truncated: list[bool]) -> list[float]:
        """Binary rewards in input order; truncated responses and responses without an answer get 0.0."""
        if not len(responses) == len(golds) == len(truncated):
            raise ValueError("responses, golds and truncated must have the same length")
        todo = [(i, pred, gold) for i, (resp, gold, cut) in enumerate(zip(responses, golds, truncated))
                if not cut and (pred := extract_answer(resp)) is not None]
        scores = [0.0] * len(responses)
        self.last_statuses = Counter()
        chunks = [todo[k:k + self.chunk] for k in range(0, len(todo), self.chunk)]
        redo = []
        for items, got in zip(chunks, self._run(chunks)):
            if got is None and len(items) > 1:
                redo += [[item] for item in items]
            for (i, _, _), value in zip(items, got or []):
                scores[i] = value
        for [(i, _, _)], got in zip(redo, self._run(redo)):
            scores[i] = got[0] if got else 0.0
        return scores
