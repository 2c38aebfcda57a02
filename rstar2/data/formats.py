"""Readers for the common layouts of math problem sets, row by row into the problem schema (rstar2/data/schema.py).

- verl: verl's RL parquet layout (its gsm8k/math preprocessing, and most RL sets shared in it): `prompt` is a chat
  list (or that list as a JSON string) whose last user turn holds the problem, `reward_model.ground_truth` the
  answer, `extra_info.index` an id, `data_source` the source.
- dapo: DAPO-Math-17k, the verl layout with DAPO's instruction paragraphs around the problem; the same reader (a
  file is named dapo when its prompts carry DAPO's head sentence, so the report says which set it saw).
- gsm8k: `question` / `answer` where the answer is a worked solution ending in `#### 72`: the answer is what follows
  the last `####`.
- solution: problem/solution sets (MATH style): the answer is the last `\\boxed{}` of the solution.
- plain: problem/answer tables (AIME, HMMT, MATH-500 uploads: `problem`/`Problem`/`question`, `answer`/`Answer`; the
  problem schema itself, `prompt`/`answer`).
- choice: GPQA-Diamond: `Question`, `Correct Answer`, `Incorrect Answer 1..3` -> a lettered multiple-choice prompt
  (options shuffled with a seed per problem) whose answer is the correct letter.

In every layout but choice, the known instruction sentences around the problem (rstar2/data/instructions.py) are
stripped and counted: our chat template carries its own instruction. A row that cannot be read (a missing field, a
prompt that is not a chat list, a solution without a box) becomes a `Bad` with its reason, never an exception; a file
in no known layout is one error naming it and its columns.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from rstar2.data import FORMATS, instructions, schema
from rstar2.data.answers import last_boxed
from rstar2.data.clean import normalise_answer, normalise_text

CHAT_FORMATS = ("verl", "dapo")  # one reader: dapo is a verl file with DAPO's instructions
PROBLEM_COLS = ("problem", "Problem", "question", "Question", "prompt", "_text")  # _text, _answer: CHAMP's
ANSWER_COLS = ("answer", "Answer", "_answer")
SOLUTION_COLS = ("solution", "Solution")
ID_COLS = ("problem_id", "id", "ID", "unique_id", "idx", "identifier")
CHOICE_COLS = ("Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3")
LETTERS = "ABCD"
GSM8K_MARK = "####"
SCHEMA = {"problem_id": pl.String, "prompt": pl.String, "answer": pl.String, "source": pl.String}


@dataclass
class Bad:
    row: int
    reason: str  # missing_field | unparsable
    detail: str


@dataclass
class Table:
    """A raw file read in one layout: its problem rows, the rows that could not be read, how many rows it had, and
    how often each instruction phrasing was stripped."""
    format: str
    rows: pl.DataFrame
    bad: list[Bad]
    rows_in: int
    stripped: dict[str, int]


def first_column(columns: list[str], names: tuple[str, ...]) -> str | None:
    return next((c for c in names if c in columns), None)


def detect(df: pl.DataFrame, path: str) -> str:
    """The layout of a raw table; one clear error naming the file and its columns when none fits."""
    cols = df.columns
    problem, answer = first_column(cols, PROBLEM_COLS), first_column(cols, ANSWER_COLS)
    if "prompt" in cols and "reward_model" in cols:
        head = instructions.DAPO_HEAD.lower()
        return "dapo" if any(head in str(p).lower() for p in df["prompt"].head(100).to_list()) else "verl"
    if all(c in cols for c in CHOICE_COLS):
        return "choice"
    if problem and answer:
        worked = df[answer].cast(pl.String, strict=False).str.contains(GSM8K_MARK, literal=True).any()
        return "gsm8k" if worked else "plain"
    if problem and first_column(cols, SOLUTION_COLS):
        return "solution"
    raise ValueError(f"{path}: no known problem layout in columns {cols}; expected verl's or DAPO's (prompt, "
                     f"reward_model), problem + answer (GSM8K's worked answers too), problem + solution, or GPQA's "
                     f"({', '.join(CHOICE_COLS)})")


def require(df: pl.DataFrame, fmt: str, path: str) -> dict[str, str]:
    """The columns `fmt` reads from this file (role -> column); one clear error naming the missing one."""
    cols = df.columns
    chat = {"prompt": ("prompt",), "answer": ("reward_model",)}
    need = {"verl": chat, "dapo": chat,
            "gsm8k": {"problem": PROBLEM_COLS, "answer": ANSWER_COLS},
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
    found["id"] = first_column(cols, ("extra_info",) if fmt in CHAT_FORMATS else ID_COLS)  # optional
    return found


def chat_problem(prompt) -> str | None:
    """The last user turn of a chat prompt (a list of {role, content}, or that list as a JSON string)."""
    if isinstance(prompt, str):
        try:
            prompt = json.loads(prompt)
        except ValueError:
            return None
    if not isinstance(prompt, list):
        return None
    users = [m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
    return users[-1] if users and isinstance(users[-1], str) else None


def gsm8k_answer(solution: str) -> str | None:
    """What follows the last `####` of a GSM8K worked solution (`... #### 1,234` -> `1,234`; the answer's
    normalisation then drops the thousands commas); None without one."""
    _, mark, answer = solution.rpartition(GSM8K_MARK)
    return (answer.strip() or None) if mark else None


def _choice(row: dict, pid: str, seed: int) -> tuple[str, str]:
    """GPQA's question with its four options in a seeded order per problem; the correct letter."""
    options = [row["Correct Answer"]] + [row[f"Incorrect Answer {i}"] for i in (1, 2, 3)]
    order = list(range(4))
    random.Random(f"{seed}/{pid}").shuffle(order)
    lines = "\n".join(f"({LETTERS[k]}) {normalise_text(str(options[i]))}" for k, i in enumerate(order))
    prompt = (f"{normalise_text(row['Question'])}\n\n{lines}\n\n"
              "Answer with the letter of the correct option, e.g. \\boxed{A}.")
    return prompt, LETTERS[order.index(0)]


def _problem_and_answer(row: dict, fmt: str, cols: dict[str, str], pid: str, seed: int) -> tuple[str, str] | str:
    """The row's problem text and raw answer, or why it cannot be read."""
    if fmt in CHAT_FORMATS:
        problem, truth = chat_problem(row["prompt"]), row["reward_model"]
        answer = truth.get("ground_truth") if isinstance(truth, dict) else None
        if not (problem or "").strip() or answer is None or not str(answer).strip():
            return "prompt is not a chat list with a user turn, or reward_model has no ground_truth"
        return problem, str(answer)
    if fmt == "solution":
        answer = last_boxed(str(row[cols["solution"]]))
        if answer is None or not answer.strip():
            return "no \\boxed{} answer in the solution"
        return str(row[cols["problem"]]), answer
    if fmt == "gsm8k":
        answer = gsm8k_answer(str(row[cols["answer"]]))
        if answer is None:
            return f"no answer after {GSM8K_MARK} in the answer"
        return str(row[cols["problem"]]), answer
    if fmt == "choice":
        return _choice(row, pid, seed)
    return str(row[cols["problem"]]), str(row[cols["answer"]])


def convert(df: pl.DataFrame, fmt: str, path: str, seed: int = 0) -> tuple[pl.DataFrame, list[Bad], dict[str, int]]:
    """Rows of a raw table in layout `fmt` as problem rows (problem_id, prompt, answer, source; instructions
    stripped, answers normalised), the rows that could not be read, and each stripped phrasing's count."""
    cols = require(df, fmt, path)
    stem = Path(path).stem
    good, bad, stripped = [], [], Counter()
    for i, row in enumerate(df.iter_rows(named=True)):
        pid = row.get(cols["id"]) if cols["id"] else None
        if fmt in CHAT_FORMATS:
            pid = pid.get("index") if isinstance(pid, dict) else None
        pid = f"{stem}-{i:06d}" if pid is None or str(pid).strip() == "" else str(pid)
        source = str(row.get("data_source") or row.get("source") or stem)
        empty = [c for r, c in cols.items() if r != "id" and (row[c] is None or str(row[c]).strip() == "")]
        if empty:
            bad.append(Bad(i, "missing_field", f"row {i} ({pid}): no {', '.join(empty)}"))
            continue
        read = _problem_and_answer(row, fmt, cols, pid, seed)
        if isinstance(read, str):
            bad.append(Bad(i, "unparsable", f"row {i} ({pid}): {read}"))
            continue
        problem, answer = read
        if fmt != "choice":  # choice's prompt is ours, instruction included
            problem, phrasings = instructions.strip(problem)
            stripped.update(phrasings)
            if not problem:
                bad.append(Bad(i, "missing_field", f"row {i} ({pid}): no problem once its instructions are stripped"))
                continue
        good.append({"problem_id": pid, "prompt": normalise_text(problem), "answer": normalise_answer(answer),
                     "source": source})
    return pl.DataFrame(good, schema=SCHEMA), bad, dict(stripped)


def read(path: str, fmt: str = "auto", seed: int = 0) -> Table:
    """A raw problem file (JSONL or Parquet) in any layout above (`auto`: detected) as problem rows. JSONL lines that
    are not objects are unreadable rows; a file with no object at all is read as no rows (format `none`)."""
    if fmt != "auto" and fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose auto or one of {', '.join(FORMATS)}")
    raw, broken = schema.read_table(path, allow_broken=True)
    lines = [Bad(line, "unparsable", f"line {line}: not a JSON object") for line in broken]
    if raw.width == 0:
        return Table("none" if fmt == "auto" else fmt, pl.DataFrame(schema=SCHEMA), lines, len(broken), {})
    fmt = detect(raw, path) if fmt == "auto" else fmt
    rows, bad, stripped = convert(raw, fmt, path, seed)
    return Table(fmt, rows, lines + bad, raw.height + len(broken), stripped)
