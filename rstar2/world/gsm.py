"""Word problems in natural language: a world made from reasoning-gym's `gsm_symbolic` (GSM8K's templates, each a
generator of a question, its integer answer and a worked solution, `answer_cot`, one arithmetic step a line).

Splits by template: `test` comes from templates never trained on (a seeded `held_out` share of the usable
templates: held-out problem types), `sft`, `train` and `val` from the others, each drawn with its own seed and
disjoint by prompt text. Only integer answers are kept (the paper's RL filter). Each problem's `solution_code` is
its worked solution as Python: a variable per step, a number that an earlier step computed (and the question does
not state) read from that step's variable, and the answer printed; it is run here and kept only when it prints the
answer (the SFT transcripts call the tool with it; rstar2.world.sft_data). reasoning-gym is imported only here, when
such a world is made.
"""

from __future__ import annotations

import io
import math
import random
import re
from contextlib import redirect_stdout

import polars as pl

from rstar2.data import clean
from rstar2.world.problems import PROBLEM_SCHEMA

DATASET = "gsm_symbolic"
_NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?")
_WORD = re.compile(r"[A-Za-z_'][\w'-]*")  # a word or a unit
# numbers joined by operators, parentheses allowed: "(12 + 3) * 4"
_ARITHMETIC = re.compile(r"[(\s]*\d+(?:\.\d+)?[)\s]*(?:[+\-*/][(\s]*\d+(?:\.\d+)?[)\s]*)+")


def usable_templates() -> list[int]:
    """The templates reasoning-gym marks as correct (`tasks_ok`)."""
    from reasoning_gym.arithmetic.gsm_symbolic.gsm_symbolic import tasks_ok

    return sorted(tasks_ok)


def split_templates(seed: int, held_out: float) -> tuple[list[int], list[int]]:
    """(trained, held out): a seeded `held_out` share of the usable templates is kept for `test` alone."""
    ids = usable_templates()
    random.Random(f"gsm-templates-{seed}").shuffle(ids)
    n = max(1, round(held_out * len(ids)))
    return sorted(ids[n:]), sorted(ids[:n])


def step_expression(line: str) -> tuple[str, float] | None:
    """The arithmetic of one worked-solution line and the number it equals (`... 35 × 3 = 105 kiwi` ->
    ('35 * 3', 105.0)): the last run of numbers and operators before the line's last `=`, units and words dropped;
    None for a line without a computation that gives its stated result."""
    if "=" not in line:
        return None
    lhs, rhs = line.rsplit("=", 1)
    result = _NUMBER.search(re.sub(r"(?<=\d),(?=\d{3})", "", rhs))
    if not result:
        return None
    lhs = re.sub(r"(?<=\d),(?=\d{3})", "", lhs).replace("×", "*").replace("÷", "/").replace("−", "-")
    lhs = re.sub(r"(\d)\s*%", r"\1 / 100", lhs)
    lhs = re.sub(r"(?<=[\d)])\s*x\s*(?=[\d($])", " * ", lhs)
    lhs = _WORD.sub(" ", re.sub(r"/\s*[A-Za-z]+", " ", lhs))  # units per something ("/day"), then words
    lhs = re.sub(r"\)\s*(?=[\d(])", ") * ", re.sub(r"(?<=\d)\s*\(", " * (", lhs))  # 3(4) and (2)(3) multiply
    runs = _ARITHMETIC.findall(re.sub(r"[$€£]", "", lhs))
    if not runs:
        return None
    expr = re.sub(r"\s+", " ", runs[-1]).strip()
    try:
        value = eval(expr, {"__builtins__": {}})  # noqa: S307 - digits and operators only
    except (SyntaxError, ZeroDivisionError, TypeError):
        return None
    want = float(result.group())
    ok = isinstance(value, (int, float)) and math.isclose(value, want, rel_tol=1e-9, abs_tol=1e-9)
    return (expr, want) if ok else None


def solution_code(question: str, cot: str, answer: str) -> str | None:
    """The worked solution as Python (see the module docstring), or None where its steps do not reach the answer."""
    stated = set(_NUMBER.findall(question.replace(",", "")))
    lines, known = [], {}  # known: a computed value's text -> the variable holding it
    for line in cot.splitlines():
        step = step_expression(line)
        if step is None or line.startswith("####"):
            continue
        expr, value = step

        def reuse(m: re.Match) -> str:
            text = m.group()
            return known.get(_canon(float(text)), text) if text not in stated else text

        name = f"x{len(lines) + 1}"
        lines.append(f"{name} = {_NUMBER.sub(reuse, expr)}")
        known[_canon(value)] = name
    if not lines:
        return None
    last = lines[-1].split(" = ")[0]
    code = "\n".join(lines + [f"print(round({last}))"])
    return code if run(code) == answer else None


def _canon(x: float) -> str:
    return f"{x:.9g}"


def run(code: str) -> str:
    """What `code` prints (our own generated code, run in-process as rstar2.world.problems.solve runs the tiny
    world's)."""
    out = io.StringIO()
    try:
        with redirect_stdout(out):
            exec(code, {"__builtins__": {"round": round, "print": print}})  # noqa: S102 - generated from the cot
    except Exception:  # noqa: BLE001 - a step that does not run is a solution left out
        return ""
    return out.getvalue().strip()


def generate(seed: int, sizes: dict[str, int], held_out: float) -> dict[str, pl.DataFrame]:
    """Splits `sft`, `train`, `val` (trained templates) and `test` (held-out templates) of the sizes asked, disjoint by
    prompt text, integer answers only; every row's `source` names its template (`gsm_symbolic/<k>`). SFT rows keep
    only problems whose solution became code."""
    import reasoning_gym

    trained, held = split_templates(seed, held_out)
    seen: set[str] = set()
    out = {}
    for i, split in enumerate(("test", "train", "sft", "val")):  # test first: it never moves
        want, rows = sizes.get(split, 0), []
        allowed = set(held if split == "test" else trained)
        ds = reasoning_gym.create_dataset(DATASET, seed=seed * 10 + i, size=max(64, 8 * want))
        for k, template in enumerate(ds.task_indices):
            if len(rows) >= want:
                break
            if template not in allowed:
                continue
            item = ds[k]
            prompt, answer = item["question"], str(item["answer"]).replace(",", "")
            if prompt in seen or not clean.is_integer(answer):
                continue
            code = solution_code(prompt, item["metadata"]["answer_cot"], answer)
            if split == "sft" and code is None:
                continue
            seen.add(prompt)
            rows.append(dict(problem_id=f"{split}-{len(rows):05d}", prompt=prompt, answer=answer,
                             source=f"{DATASET}/{template}", solution_code=code or ""))
        if len(rows) < want:
            raise ValueError(f"gsm_symbolic: drew only {len(rows)} of {want} {split} problems (seed {seed})")
        out[split] = pl.DataFrame(rows, schema=PROBLEM_SCHEMA)
    return out
