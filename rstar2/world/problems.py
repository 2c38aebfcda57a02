"""Synthetic math problems with verifiable integer answers.

Each kind is tedious to do in one's head (or in a 4M-parameter model's weights) and easy with one line of Python,
so the tool is what separates right from wrong answers. Every problem carries the reference solution code; the SFT
data uses it to teach the tool protocol, never the RL or evaluation splits' answers.
"""

from __future__ import annotations

import math
import random
from typing import Callable

import polars as pl

from rstar2.data import schema

PROBLEM_SCHEMA = {**schema.COLUMNS, "solution_code": pl.String}  # the problem table, plus the reference code
SPLITS = ("sft", "train", "val", "test")


def _mul(r: random.Random) -> tuple[str, str]:
    a, b = r.randint(12, 99), r.randint(12, 99)
    q = r.choice(["Compute {a} * {b}.", "What is the product of {a} and {b}?"]).format(a=a, b=b)
    return q, f"print({a} * {b})"


def _add(r: random.Random) -> tuple[str, str]:
    xs = [r.randint(10, 99) for _ in range(r.randint(3, 4))]
    q = r.choice(["What is {s}?", "Compute the sum {s}."]).format(s=" + ".join(map(str, xs)))
    return q, f"print({' + '.join(map(str, xs))})"


def _mod(r: random.Random) -> tuple[str, str]:
    a, e, m = r.randint(2, 99), r.randint(10, 99), r.randint(7, 97)
    q = r.choice(["What is the remainder when {a}^{e} is divided by {m}?", "Compute {a}^{e} mod {m}."])
    return q.format(a=a, e=e, m=m), f"print(pow({a}, {e}, {m}))"


def _range_sum(r: random.Random) -> tuple[str, str]:
    a, b, p = r.randint(1, 60), r.randint(61, 99), r.choice([1, 2])
    what = {1: "integers", 2: "squares of the integers"}[p]
    return f"What is the sum of the {what} from {a} to {b}?", f"print(sum(i ** {p} for i in range({a}, {b} + 1)))"


def _divisors(r: random.Random) -> tuple[str, str]:
    n = r.randint(100, 9999)
    return (f"How many positive divisors does {n} have?",
            f"n = {n}\nprint(sum(1 for d in range(1, n + 1) if n % d == 0))")


def _comb(r: random.Random) -> tuple[str, str]:
    n, k = r.randint(10, 150), r.randint(2, 3)
    q = r.choice(["How many ways are there to choose {k} items from {n}?",
                  "Compute the binomial coefficient C({n}, {k}).",
                  "In how many ways can a team of {k} be picked from {n} people?"])
    return q.format(n=n, k=k), f"import math\nprint(math.comb({n}, {k}))"


KINDS: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "mul": _mul, "add": _add, "mod": _mod, "range_sum": _range_sum, "divisors": _divisors, "comb": _comb,
}


def solve(code: str) -> str:
    """Reference answer: run the trusted solution code in-process (our own generator's code, not model output)."""
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(code, {"math": math})  # noqa: S102 - generator-authored code only
    return buf.getvalue().strip()


def generate(seed: int, sizes: dict[str, int], kinds: list[str] | None = None) -> dict[str, pl.DataFrame]:
    """Disjoint splits (by prompt text), deterministic in `seed`; returns split name -> DataFrame.

    The held-out and RL splits are drawn first; a kind whose small space of distinct problems runs out (e.g. small
    binomials) is skipped for the rest of the split, so only the SFT split (format teaching) and the val split
    (drawn last, so that adding it changed no other split) can lack it."""
    kinds = kinds or list(KINDS)
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown problem kinds {sorted(unknown)}; known: {sorted(KINDS)}")
    r = random.Random(seed)
    seen: set[str] = set()
    out: dict[str, pl.DataFrame] = {}
    for split in ("test", "train", "sft", "val"):  # test first: it never moves; val last: adding it moves nothing
        rows: list[dict] = []
        live = list(kinds)
        misses = dict.fromkeys(kinds, 0)
        while len(rows) < sizes.get(split, 0):
            if not live:
                raise ValueError(f"cannot draw {sizes[split]} distinct {split} problems from kinds {kinds}")
            kind = live[len(rows) % len(live)]
            prompt, code = KINDS[kind](r)
            if prompt in seen:
                misses[kind] += 1
                if misses[kind] > 200:  # this kind's space is exhausted
                    live.remove(kind)
                continue
            misses[kind] = 0
            seen.add(prompt)
            rows.append(dict(problem_id=f"{split}-{len(rows):05d}", prompt=prompt, answer=solve(code),
                             source=kind, solution_code=code))
        out[split] = pl.DataFrame(rows, schema=PROBLEM_SCHEMA)
    return out

