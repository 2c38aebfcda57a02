"""Outcome reward, paper §2.2.1 Eq. 3: r = 1 if the answer in `\\boxed{}` inside `<answer>` is equivalent to
the ground truth (rule-based Math-Verify), else 0. No format reward, no tool-error penalty (paper §2.2.3).

Unlike the released code (last `\\boxed{}` anywhere, PRIME heuristics first: notes §5, §10 row 6) we follow
the paper: a stray `\\boxed{}` in a later `<reason>` block cannot decide the reward. As in the paper (§3.1) and the
released code (notes §5), the check runs in the code-execution service, under its own wall-clock timeout: a
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

from rstar2.sandbox import OK, ExecRequest
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


VERIFY_CODE = "import json, math, sys, threading\n" + inspect.getsource(verify_one) + """
_item = json.loads(sys.stdin.read())
print(verify_one(_item["pred"], _item["gold"], _item["timeout_s"]))
"""  # runs in the sandbox ("verify" executor: math-verify preloaded), one item per call, the answer on stdin


class Verifier:
    """Scores batches through a sandbox backend (anything with `run_batch`), one call per item with an answer.
    `timeout_s` is the verification's own wall-clock limit per item (Math-Verify's internal ones get the same);
    `code` is the checking program (reads {"pred", "gold", "timeout_s"} as JSON on stdin, prints the score)."""

    def __init__(self, sandbox, timeout_s: float = 2.0, code: str = VERIFY_CODE):
        self.sandbox, self.timeout_s, self.code = sandbox, timeout_s, code
        self.last_statuses: Counter = Counter()  # sandbox statuses of the last batch's checks

    def score(self, responses: list[str], golds: list[str], truncated: list[bool]) -> list[float]:
        """Binary rewards in input order; truncated responses and responses without an answer get 0.0."""
        if not len(responses) == len(golds) == len(truncated):
            raise ValueError("responses, golds and truncated must have the same length")
        todo = [(i, pred, gold) for i, (resp, gold, cut) in enumerate(zip(responses, golds, truncated))
                if not cut and (pred := extract_answer(resp)) is not None]
        reqs = [ExecRequest(self.code, json.dumps({"pred": pred, "gold": gold, "timeout_s": self.timeout_s}),
                            timeout_s=self.timeout_s) for _, pred, gold in todo]
        scores = [0.0] * len(responses)
        self.last_statuses = Counter()
        for (i, pred, _), res in zip(todo, self.sandbox.run_batch(reqs) if reqs else []):
            self.last_statuses[res.status] += 1
            if res.status == OK and res.stdout.strip() in ("0.0", "1.0"):
                scores[i] = float(res.stdout)
            elif res.status != OK:
                log.warning("verification of item %d (answer %.80r) ended %s: scored 0.0 (%s)", i, pred, res.status,
                            res.stderr.strip()[-200:])
        return scores
