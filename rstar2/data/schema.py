"""The problem table every split and suite is read as (the one definition; world loading validates against it).

Parquet (or JSONL, one object per line) with these columns:

    problem_id  str, unique      e.g. "dapo-00017"
    prompt      str, non-empty   the problem text as the user asks it (the chat template adds the rest)
    answer      str, non-empty   the reference answer: an integer for RL data ("42"), LaTeX for math suites
    source      str              where the row came from (dataset or file name)

More columns are kept as they are (the tiny world's generator adds `solution_code`). `rstar2 data import` writes
this layout from the layouts of rstar2/data/formats.py (verl's and DAPO's, GSM8K, problem/solution, problem/answer).
"""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl

from rstar2.data import files

COLUMNS = {"problem_id": pl.String, "prompt": pl.String, "answer": pl.String, "source": pl.String}
REQUIRED = ("problem_id", "prompt", "answer")


JSONL = (".jsonl", ".json", ".ndjson")


def _strings(value):
    """Numbers and booleans as strings, inside dicts and lists too (`reward_model.ground_truth` mixes them as well)."""
    if isinstance(value, dict):
        return {k: _strings(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_strings(v) for v in value]
    return str(value) if isinstance(value, (int, float, bool)) else value


def read_jsonl(path: Path) -> tuple[pl.DataFrame, list[int]]:
    """The objects of a JSONL file, one row each, and the numbers (1-based) of the lines that are not a JSON object.
    Numbers and booleans become strings (an answer column often mixes `42` and `"\\frac{1}{2}"`). A UTF-8 byte-order
    mark and CRLF line ends (files saved on Windows) are read as if absent."""
    rows, broken = [], []
    for i, line in enumerate(path.read_text(encoding="utf-8-sig").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            obj = None
        if not isinstance(obj, dict):
            broken.append(i)
            continue
        rows.append(_strings(obj))
    return pl.DataFrame(rows, infer_schema_length=None), broken


def read_table(path: str | Path, allow_broken: bool = False) -> tuple[pl.DataFrame, list[int]] | pl.DataFrame:
    """A Parquet or JSONL file (or a .json document of records: `read_json_document`) as a frame; one clear error
    naming the file for anything else (another file type, an unreadable file, a JSONL line that is not an object).
    `allow_broken`: return (frame, broken JSONL line numbers) instead of failing on such lines."""
    try:
        p = files.resolve(path)  # a path, or pkg:<module>/<file> inside an installed distribution
    except FileNotFoundError as e:
        raise ValueError(str(e)) from None
    if not p.is_file():
        raise ValueError(f"{path}: no such file")
    if p.suffix not in (".parquet", *JSONL):
        raise ValueError(f"{p}: unknown file type {p.suffix!r}; problem tables are .parquet or .jsonl")
    try:
        df, broken = (pl.read_parquet(p), []) if p.suffix == ".parquet" else read_jsonl(p)
    except Exception as e:  # noqa: BLE001 - the reader's own message, with the file named
        raise ValueError(f"{p}: cannot be read as {p.suffix[1:]} ({str(e).splitlines()[0]})") from e
    if broken and df.width == 0 and p.suffix == ".json":  # one JSON document, not JSON lines
        df, broken = read_json_document(p), []
    if broken and df.width == 0:  # not one object: not JSONL at all (e.g. one pretty-printed JSON document)
        raise ValueError(f"{p}: no line is a JSON object (JSONL holds one object a line), e.g. line {broken[0]}")
    if allow_broken:
        return df, broken
    if broken:
        raise ValueError(f"{p}: line(s) {broken[:5]} are not JSON objects")
    return df


def read_json_document(path: Path) -> pl.DataFrame:
    """One JSON document of records: a list of objects, or an object holding them under `problems`, `data` or
    `rows` as a list or as a mapping id -> object (CHAMP's `dataset_files/v0.json`; the key becomes `id` where the
    object has none); one clear error naming the file for anything else."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8-sig"))
    except ValueError as e:
        raise ValueError(f"{path}: neither JSON lines nor one JSON document ({e})") from None
    if isinstance(doc, dict):
        doc = next((doc[k] for k in ("problems", "data", "rows") if isinstance(doc.get(k), (list, dict))), doc)
    if isinstance(doc, dict) and doc and all(isinstance(v, dict) for v in doc.values()):
        doc = [{"id": k, **v} if "id" not in v else v for k, v in doc.items()]
    if not isinstance(doc, list) or not doc or not all(isinstance(r, dict) for r in doc):
        raise ValueError(f"{path}: a JSON document of records is a list of objects, or an object holding them under "
                         "`problems`, `data` or `rows`")
    flat = [{k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in r.items()} for r in doc]  # nested
    return pl.DataFrame([_strings(r) for r in flat], infer_schema_length=None)  # fields kept as JSON text


def malformed(df: pl.DataFrame) -> pl.Expr:
    """Rows that cannot be used: a missing id, or an empty prompt or answer."""
    empty = lambda c: pl.col(c).is_null() | (pl.col(c).cast(pl.String).str.strip_chars() == "")  # noqa: E731
    return empty("problem_id") | empty("prompt") | empty("answer")


def validate(df: pl.DataFrame, where: str = "problem table") -> pl.DataFrame:
    """Check a problem table before it is used (columns, no malformed rows, unique ids); one clear error naming
    `where` (the file) and what is wrong. Answers become strings; a missing `source` is filled with `where`'s name."""
    missing = [c for c in REQUIRED if c not in df.columns]
    if missing:
        raise ValueError(f"{where} lacks column(s) {missing}; it has {df.columns} (needs {list(REQUIRED)}; "
                         f"`rstar2 data import` converts other layouts)")
    df = df.with_columns(pl.col(c).cast(pl.String) for c in REQUIRED)
    if "source" not in df.columns:
        df = df.with_columns(source=pl.lit(Path(where).stem))
    bad = df.filter(malformed(df))
    if bad.height:
        raise ValueError(f"{where}: {bad.height} malformed row(s) (missing id, empty prompt or answer), "
                         f"e.g. {bad['problem_id'].head(3).to_list()}")
    if df["problem_id"].n_unique() != df.height:
        dup = df.filter(pl.col("problem_id").is_duplicated())["problem_id"].unique().head(3).to_list()
        raise ValueError(f"{where}: problem_id values are not unique, e.g. {dup}")
    return df
