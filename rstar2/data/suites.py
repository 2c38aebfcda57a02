"""Evaluation suites (`eval.suites`): local files of AIME 2024/2025, HMMT, MATH-500, GPQA-Diamond and the like, read
into the problem schema. The layout follows the answer type: `choice` reads GPQA's columns (a lettered prompt, the
correct letter as the answer); `integer` and `math` read any other layout `rstar2 data import` reads: problem +
answer, problem + solution (the solution's last `\\boxed{}`), GSM8K's worked answers, verl's chat prompts. An
integer suite whose answers are not all integers, a missing column or an unreadable row is one error naming the file:
an evaluation set is used whole or not at all."""

from __future__ import annotations

import polars as pl

from rstar2.core.config import SuiteCfg
from rstar2.data import clean, formats, schema


def _layout(raw: pl.DataFrame, path: str) -> str:
    """A non-choice suite's layout: the import's (rstar2/data/formats.py), or plain when its columns fit none (then
    `convert` names the missing column)."""
    try:
        fmt = formats.detect(raw, path)
    except ValueError:
        return "plain"
    return "plain" if fmt == "choice" else fmt


def load(suite: SuiteCfg, seed: int = 0) -> pl.DataFrame:
    """The suite's problems (problem_id, prompt, answer, source = the suite's name); `suite.max_problems` of them
    drawn with `seed` where it is set."""
    raw = schema.read_table(suite.path)
    fmt = "choice" if suite.answer_type == "choice" else _layout(raw, suite.path)
    df, bad, _ = formats.convert(raw, fmt, suite.path, seed)
    if bad:
        raise ValueError(f"suite {suite.name} ({suite.path}): {len(bad)} unreadable row(s), e.g. {bad[0].detail}")
    if suite.answer_type == "integer":
        odd = df.filter(~pl.col("answer").map_elements(clean.is_integer, return_dtype=pl.Boolean))
        if odd.height:
            raise ValueError(f"suite {suite.name} ({suite.path}): answer_type is integer but {odd.height} answer(s) "
                             f"are not, e.g. {odd['answer'].head(2).to_list()} (use answer_type: math)")
    df = schema.validate(df.with_columns(source=pl.lit(suite.name)), suite.path)
    if suite.max_problems and suite.max_problems < df.height:  # a seeded subset, in the file's order
        df = df.with_row_index("_i").sample(suite.max_problems, seed=seed).sort("_i").drop("_i")
    return df


def problems(suites: list[SuiteCfg], seed: int = 0) -> dict[str, str]:
    """Every suite problem's text by `<suite>/<problem_id>` (what decontamination compares training data against)."""
    return {f"{s.name}/{r['problem_id']}": r["prompt"] for s in suites for r in load(s, seed).iter_rows(named=True)}
