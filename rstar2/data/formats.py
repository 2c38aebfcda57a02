"""Readers for the common layouts of math problem sets, row by row into the problem schema (rstar2/data/schema.py).

- dapo: DAPO-Math-17k / verl's RL layout: `prompt` is a chat list whose user turn holds the problem (DAPO's own
  instruction paragraphs around it are dropped: the chat template carries ours), `reward_model.ground_truth` the
  answer, `extra_info.index` an id, `data_source` the source.
- solution: problem/solution sets (MATH style): the answer is the last `\\boxed{}` of the solution.
- plain: problem/answer tables (AIME, HMMT, MATH-500 uploads: `problem`/`Problem`/`question`, `answer`/`Answer`).
- choice: GPQA-Diamond: `Question`, `Correct Answer`, `Incorrect Answer 1..3` -> a lettered multiple-choice prompt
  (options shuffled with a seed per problem) whose answer is the correct letter.

A row that cannot be read (a missing field, a prompt that is not a chat list, a solution without a box) becomes a
`Bad` with its reason, never an exception; a file in no known layout is one error naming it and its columns.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from rstar2.data.clean import normalise_answer, normalise_text
from rstar2.reward import last_boxed

FORMATS = ("dapo", "solution", "plain", "choice")
PROBLEM_COLS = ("problem", "Problem", "question", "Question")
ANSWER_COLS = ("answer", "Answer")
SOLUTION_COLS = ("solution", "Solution")
ID_COLS = ("problem_id", "id", "ID", "unique_id", "idx")
CHOICE_COLS = ("Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3")
LETTERS = "ABCD"
_DAPO_HEAD = "Solve the following math problem"
_DAPO_TAIL = "Remember to put your answer"


@dataclass
class Bad:
    row: int
    reason: str  # missing_field | unparsable
    detail: str


def first_column(columns: list[str], names: tuple[str, ...]) -> str | None:
    return next((c for c in names if c in columns), None)


def detect(df: pl.DataFrame, path: str) -> str:
    """The layout of a raw table; one clear error naming the file and its columns when none fits."""
    cols = df.columns
    if "prompt" in cols and "reward_model" in cols:
        return "dapo"
    if all(c in cols for c in CHOICE_COLS):
        return "choice"
    if first_column(cols, PROBLEM_COLS) and first_column(cols, ANSWER_COLS):
        return "plain"
    if first_column(cols, PROBLEM_COLS) and first_column(cols, SOLUTION_COLS):
        return "solution"
    raise ValueError(f"{path}: no known problem layout in columns {cols}; expected DAPO's (prompt, reward_model), "
                     f"problem + answer, problem + solution, or GPQA's ({', '.join(CHOICE_COLS)})")


def require(df: pl.DataFrame, fmt: str, path: str) -> dict[str, str]:
    """The columns `fmt` reads from this file (role -> column); one clear error naming the missing one."""
    cols = df.columns
    need = {"dapo": {"prompt": ("prompt",), "answer": ("reward_model",)},
            "solution": {"problem": PROBLEM_COLS, "solution": SOLUTION_COLS},
            "plain": {"problem": PROBLEM_COLS, "answer": ANSWER_COLS},
            "choice": {c: (c,) for c in CHOICE_COLS}}[fmt]
    found = {}
    for role, names in need.items():
        col = first_column(cols, names)
        if col is None:
            raise ValueError(f"{path}: the {fmt} layout needs the {role} column (one of {', '.join(names)}); it has "
                             f"{cols}")
        found[role] = col
    found["id"] = first_column(cols, ("extra_info",) if fmt == "dapo" else ID_COLS)  # optional
    return found


def _dapo_problem(prompt) -> str | None:
    """The problem inside a DAPO chat prompt (a list of {role, content}, or that list as a JSON string)."""
    if isinstance(prompt, str):
        try:
            prompt = json.loads(prompt)
        except ValueError:
            return None
    if not isinstance(prompt, list):
        return None
    users = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
    if not users or not isinstance(users[-1], str):
        return None
    paras = users[-1].strip().split("\n\n")
    if len(paras) > 1 and paras[0].startswith(_DAPO_HEAD):
        paras = paras[1:]
    if len(paras) > 1 and paras[-1].startswith(_DAPO_TAIL):
        paras = paras[:-1]
    return "\n\n".join(paras)


def _choice(row: dict, pid: str, seed: int) -> tuple[str, str]:
    """GPQA's question with its four options in a seeded order per problem; the correct letter."""
    options = [row["Correct Answer"]] + [row[f"Incorrect Answer {i}"] for i in (1, 2, 3)]
    order = list(range(4))
    random.Random(f"{seed}/{pid}").shuffle(order)
    lines = "\n".join(f"({LETTERS[k]}) {normalise_text(str(options[i]))}" for k, i in enumerate(order))
    prompt = (f"{normalise_text(row['Question'])}\n\n{lines}\n\n"
              "Answer with the letter of the correct option, e.g. \\boxed{A}.")
    return prompt, LETTERS[order.index(0)]


def convert(df: pl.DataFrame, fmt: str, path: str, seed: int = 0) -> tuple[pl.DataFrame, list[Bad]]:
    """Rows of a raw table in layout `fmt` as problem rows (problem_id, prompt, answer, source; answers
    normalised), and the rows that could not be read."""
    cols = require(df, fmt, path)
    stem = Path(path).stem
    good, bad = [], []
    for i, row in enumerate(df.iter_rows(named=True)):
        pid = row.get(cols["id"]) if cols["id"] else None
        if fmt == "dapo":
            pid = pid.get("index") if isinstance(pid, dict) else None
        pid = f"{stem}-{i:06d}" if pid is None or str(pid).strip() == "" else str(pid)
        source = str(row.get("data_source") or row.get("source") or stem)
        empty = [c for r, c in cols.items() if r != "id" and (row[c] is None or str(row[c]).strip() == "")]
        if empty:
            bad.append(Bad(i, "missing_field", f"row {i} ({pid}): no {', '.join(empty)}"))
            continue
        if fmt == "dapo":
            problem, truth = _dapo_problem(row["prompt"]), row["reward_model"]
            answer = truth.get("ground_truth") if isinstance(truth, dict) else None
            if not (problem or "").strip() or answer is None or not str(answer).strip():
                bad.append(Bad(i, "unparsable", f"row {i} ({pid}): prompt is not a chat list with a user turn, or "
                                                f"reward_model has no ground_truth"))
                continue
        elif fmt == "solution":
            problem, answer = row[cols["problem"]], last_boxed(str(row[cols["solution"]]))
            if answer is None or not answer.strip():
                bad.append(Bad(i, "unparsable", f"row {i} ({pid}): no \\boxed{{}} answer in the solution"))
                continue
        elif fmt == "choice":
            problem, answer = _choice(row, pid, seed)
        else:
            problem, answer = row[cols["problem"]], row[cols["answer"]]
        good.append({"problem_id": pid, "prompt": normalise_text(str(problem)),
                     "answer": normalise_answer(str(answer)), "source": source})
    out = pl.DataFrame(good, schema={"problem_id": pl.String, "prompt": pl.String, "answer": pl.String,
                                     "source": pl.String})
    return out, bad
