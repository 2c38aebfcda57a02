"""`rstar2 data import`: a raw problem set (JSONL or Parquet, any layout of rstar2/data/formats.py) -> the problem
schema (rstar2/data/schema.py), through the paper's data pipeline: normalisation (instruction sentences stripped and
counted), for RL data the integer-answer filter, exact then near-duplicate removal, decontamination against the
evaluation suites; every dropped row counted by reason with examples (the report)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import polars as pl

from rstar2.data import clean, decontam, dedup, formats, schema

REASONS = ("missing_field", "unparsable", "non_integer", "exact_duplicate", "near_duplicate", "contaminated",
           "duplicate_id")
EXAMPLES = 2  # examples kept per reason; every contaminated row is kept with the suite problem it matched


@dataclass
class Report:
    path: str
    format: str
    rows_in: int = 0
    rows_out: int = 0
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    examples: dict[str, list[str]] = field(default_factory=lambda: {r: [] for r in REASONS})
    stripped: dict[str, int] = field(default_factory=dict)  # instruction phrasing -> times it was stripped

    def drop(self, reason: str, example: str) -> None:
        self.dropped[reason] += 1
        if len(self.examples[reason]) < EXAMPLES or reason == "contaminated":
            self.examples[reason].append(example[:200])

    def to_dict(self) -> dict:
        return asdict(self)


def _sift(rep: Report, rows: list[dict], why: list[tuple[str, str] | None]) -> list[dict]:
    """The rows whose `why` is None; the others are counted in the report under their (reason, example)."""
    for w in why:
        if w is not None:
            rep.drop(*w)
    return [r for r, w in zip(rows, why) if w is None]


def _first_seen(rows: list[dict], key, reason: str, what: str, label) -> list[tuple[str, str] | None]:
    """None for the first row of each `key`, (reason, "<id> <what> <label of that first row>") for the later ones."""
    seen: dict = {}
    why = []
    for r in rows:
        k = key(r)
        why.append((reason, f"{r['problem_id']} {what} {seen[k]}") if k in seen else None)
        seen.setdefault(k, label(r))
    return why


def import_problems(path: str, fmt: str = "auto", split: str = "rl", near_threshold: float = 0.8,
                    shingle: int = 3, suites: dict[str, str] | None = None, decontam_ngram: int = 13,
                    seed: int = 0) -> tuple[pl.DataFrame, Report]:
    """The problems of `path` in the schema, and the report. `split` rl keeps integer answers only (eval keeps all);
    `suites`: evaluation problems (id -> text) a kept problem must not contain or overlap (rstar2/data/decontam.py).
    Every row read is either kept or counted under one reason: rows_in == rows_out + sum(dropped)."""
    table = formats.read(path, fmt, seed)
    df = table.rows
    rep = Report(path, table.format, rows_in=table.rows_in, stripped=table.stripped)
    for b in table.bad:
        rep.drop(b.reason, b.detail)
    rows = df.to_dicts()
    if split == "rl":
        rows = _sift(rep, rows, [None if clean.is_integer(r["answer"]) else
                                 ("non_integer", f"{r['problem_id']}: answer {r['answer']!r}") for r in rows])
    rows = _sift(rep, rows, _first_seen(rows, lambda r: dedup.key(r["prompt"]), "exact_duplicate", "repeats",
                                        lambda r: r["problem_id"]))
    near = dedup.near_duplicates([r["prompt"] for r in rows], near_threshold, shingle, seed=seed)
    rows = _sift(rep, rows, [("near_duplicate", f"{r['problem_id']} ~ {rows[near[i]]['problem_id']}")
                             if i in near else None for i, r in enumerate(rows)])
    if suites:
        index = decontam.Index(suites, decontam_ngram)
        rows = _sift(rep, rows, [("contaminated", f"{r['problem_id']} {h[0]} {h[1]}")
                                 if (h := index.hit(r["prompt"])) else None for r in rows])
    rows = _sift(rep, rows, _first_seen(rows, lambda r: r["problem_id"], "duplicate_id", "is already the id of",
                                        lambda r: repr(r["prompt"][:40])))
    out = pl.DataFrame(rows, schema=df.schema)
    rep.rows_out = out.height
    assert rep.rows_in == rep.rows_out + sum(rep.dropped.values()), rep  # every row kept or counted
    return schema.validate(out, path), rep


def nothing_left(rep: Report) -> str:
    """Why an import kept no row, in one line: `no rows left: 12 in, 12 dropped as non_integer`."""
    drops = ", ".join(f"{n} dropped as {reason}" for reason, n in rep.dropped.items() if n)
    return f"no rows left: {rep.rows_in} in, {drops}" if drops else f"no rows left: {rep.path} holds no rows"


def log_to_mlflow(experiment: str, out_dir: str, out_uri: str, rep: Report) -> str:
    """The imported table as a dataset input of an MLflow run of its own (keyed by the output file, so importing
    again logs into the same run), the report as its lineage artifact and its counts as metrics; returns the run id.
    An import that kept no row has no table: only its report and counts are logged."""
    from rstar2.core import tracking
    exp_id = tracking.setup(experiment, out_dir)
    name = Path(out_uri).stem
    run_id = tracking.find_or_create_run(exp_id, f"data-import-{name}", f"data-import:{Path(out_uri).resolve()}",
                                         tags={"kind": "data-import", "format": rep.format})
    if rep.rows_out:
        tracking.log_dataset(run_id, out_uri, name, "import", rep.to_dict())
    else:
        tracking.client().log_dict(run_id, rep.to_dict(), f"datasets/{name}.json")
    tracking.log_metrics(run_id, {"rows_in": rep.rows_in, "rows_out": rep.rows_out,
                                  **{f"dropped_{k}": v for k, v in rep.dropped.items()}}, 0)
    tracking.end(run_id)
    return run_id
