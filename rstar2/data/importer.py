"""`rstar2 data import`: a raw problem set (JSONL or Parquet, any layout of rstar2/data/formats.py) -> the problem
schema (rstar2/data/schema.py), through the paper's data pipeline: normalisation, for RL data the integer-answer
filter, exact then near-duplicate removal, decontamination against the evaluation suites; every dropped row counted
by reason with examples (the report)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import polars as pl

from rstar2.data import clean, decontam, dedup, formats, schema

REASONS = ("missing_field", "unparsable", "non_integer", "exact_duplicate", "near_duplicate", "contaminated",
           "duplicate_id")
EXAMPLES = 2


@dataclass
class Report:
    path: str
    format: str
    rows_in: int = 0
    rows_out: int = 0
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    examples: dict[str, list[str]] = field(default_factory=lambda: {r: [] for r in REASONS})

    def drop(self, reason: str, example: str) -> None:
        self.dropped[reason] += 1
        if len(self.examples[reason]) < EXAMPLES:
            self.examples[reason].append(example[:200])

    def to_dict(self) -> dict:
        return asdict(self)


def _keep(df: pl.DataFrame, mask: list[bool]) -> pl.DataFrame:
    return df.filter(pl.Series(mask, dtype=pl.Boolean))


def import_problems(path: str, fmt: str = "auto", split: str = "rl", near_threshold: float = 0.8,
                    shingle: int = 3, suites: dict[str, str] | None = None, decontam_ngram: int = 13,
                    seed: int = 0) -> tuple[pl.DataFrame, Report]:
    """The problems of `path` in the schema, and the report. `split` rl keeps integer answers only (eval keeps all);
    `suites`: evaluation problems (id -> text) a kept problem must not overlap in a `decontam_ngram`-word n-gram."""
    raw, broken = schema.read_table(path, allow_broken=True)
    fmt = formats.detect(raw, path) if fmt == "auto" else fmt
    if fmt not in formats.FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose auto or one of {', '.join(formats.FORMATS)}")
    df, bad = formats.convert(raw, fmt, path, seed)
    rep = Report(path, fmt, rows_in=raw.height + len(broken))
    for line in broken:
        rep.drop("unparsable", f"line {line}: not a JSON object")
    for b in bad:
        rep.drop(b.reason, b.detail)
    rows = df.to_dicts()
    if split == "rl":
        ok = [clean.is_integer(r["answer"]) for r in rows]
        for r, k in zip(rows, ok):
            if not k:
                rep.drop("non_integer", f"{r['problem_id']}: answer {r['answer']!r}")
        df, rows = _keep(df, ok), [r for r, k in zip(rows, ok) if k]
    seen: dict[str, str] = {}
    ok = []
    for r in rows:
        k = dedup.key(r["prompt"])
        ok.append(k not in seen)
        if k in seen:
            rep.drop("exact_duplicate", f"{r['problem_id']} repeats {seen[k]}")
        seen.setdefault(k, r["problem_id"])
    df, rows = _keep(df, ok), [r for r, k in zip(rows, ok) if k]
    near = dedup.near_duplicates([r["prompt"] for r in rows], near_threshold, shingle, seed=seed)
    for i, j in near.items():
        rep.drop("near_duplicate", f"{rows[i]['problem_id']} ~ {rows[j]['problem_id']}")
    ok = [i not in near for i in range(len(rows))]
    df, rows = _keep(df, ok), [r for r, k in zip(rows, ok) if k]
    if suites:
        index = decontam.Index(suites, decontam_ngram)
        hits = [index.hit(r["prompt"]) for r in rows]
        for r, h in zip(rows, hits):
            if h is not None:
                rep.drop("contaminated", f"{r['problem_id']} overlaps {h}")
        ok = [h is None for h in hits]
        df, rows = _keep(df, ok), [r for r, k in zip(rows, ok) if k]
    ids: set[str] = set()
    ok = []
    for r in rows:
        ok.append(r["problem_id"] not in ids)
        if r["problem_id"] in ids:
            rep.drop("duplicate_id", f"{r['problem_id']} (another problem has this id)")
        ids.add(r["problem_id"])
    df = _keep(df, ok)
    rep.rows_out = df.height
    return schema.validate(df, path), rep


def log_to_mlflow(experiment: str, out_dir: str, out_uri: str, rep: Report) -> str:
    """The imported table as a dataset input of an MLflow run of its own (keyed by the output file, so importing
    again logs into the same run), the report as its lineage artifact and its counts as metrics; returns the run id."""
    from rstar2 import tracking

    exp_id = tracking.setup(experiment, out_dir)
    name = Path(out_uri).stem
    run_id = tracking.find_or_create_run(exp_id, f"data-import-{name}", f"data-import:{Path(out_uri).resolve()}",
                                         tags={"kind": "data-import", "format": rep.format})
    tracking.log_dataset(run_id, out_uri, name, "import", rep.to_dict())
    tracking.log_metrics(run_id, {"rows_in": rep.rows_in, "rows_out": rep.rows_out,
                                  **{f"dropped_{k}": v for k, v in rep.dropped.items()}}, 0)
    tracking.end(run_id)
    return run_id
