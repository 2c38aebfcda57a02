"""Make the whole world under one directory: problem splits (the tiny world's kinds, or GSM8K-style word problems),
SFT transcripts, and the initial model (the tiny world's tokenizer and model, or a pretrained one brought in); and
bring in the user's problem tables (world.train_data / val_data / test_data) whenever they are set."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl

from rstar2.core.checkpoint import commit, is_committed, sha256, write_atomic
from rstar2.core.config import RunCfg
from rstar2.core.layout import WorldLayout
from rstar2.data import clean, formats, schema
from rstar2.models import importer
from rstar2.rollout.chat import ChatFormat
from rstar2.rollout.template import REASON_OPEN
from rstar2.training import transcripts
from rstar2.world import gsm, model, problems, sft_data, tokenizer

SPLITS = ("train", "val", "test")


def _source(cfg: RunCfg, split: str) -> str | None:
    return getattr(cfg.world, f"{split}_data")


def uris(cfg: RunCfg, out: Path, fitted: bool = True) -> dict[str, str]:
    """Which parts of the world under `out` (its files: rstar2.core.layout.WorldLayout) this config uses: problem
    splits (the user's own, brought in, when world.<split>_data is set, else the generator's), SFT transcripts, init
    model. `fitted`: a split the preflight dropped prompts from is its kept rows (while the split's content is the one
    the preflight read: its SHA-256 in the record), and `fit` names the preflight's record (the suites' dropped
    ids)."""
    w, files = cfg.world, WorldLayout(dir=out)
    found = {k: str(files.table(k)) for k in ("sft_problems", "train", "val", "test")}
    found["sft_data"] = cfg.sft.data or str(files.sft_data)
    found.update({s: str(files.imported(s)) for s in SPLITS if _source(cfg, s)})
    found["init_model"] = w.base_model or str(files.init_model)
    for split in ("val", "test"):
        if w.base_model and not _source(cfg, split):
            del found[split]  # optional with real assets and eval.suites; asking to evaluate on it then fails clearly
    if fitted and files.fit.is_file():
        read = json.loads(files.fit.read_text()).get("sources", {})  # split -> SHA-256 the preflight read
        for split in [s for s in SPLITS if s in found and s in read]:
            kept = files.fitted(split)
            if kept.is_file() and read[split] == file_sha256(found[split]):
                found[split] = str(kept)  # else the split changed since the preflight: whole, until it runs again
        found["fit"] = str(files.fit)
    return found


def file_sha256(path: str | Path) -> str | None:
    """The file's content hash (None where there is no such file)."""
    return sha256(Path(path)) if Path(path).is_file() else None


def ensure(cfg: RunCfg, out: Path) -> tuple[dict[str, str], dict[str, dict]]:
    """The world under `out`, made once (committed atomically; a later call reuses it), with the user's problem
    tables brought in again whenever their content changed: (its URIs, the records of the tables brought in now)."""
    if not is_committed(out):
        commit(out, lambda tmp: build(cfg, tmp), {"kind": "world", "seed": cfg.seed})
    synced = sync_data(cfg, out)
    return uris(cfg, out), synced


def build(cfg: RunCfg, out: Path) -> dict[str, str]:
    """Make the world under `out` (nothing to generate with world.base_model, beyond checking that the splits RL and
    evaluation need are set: train, and test unless eval.suites is set); returns its URIs (see `uris`). The user's
    tables are brought in by `sync_data`."""
    w = cfg.world
    out.mkdir(parents=True, exist_ok=True)
    paths = uris(cfg, out)
    if w.base_model:
        needed = ("train",) if cfg.eval.suites else ("train", "test")  # suites replace the test split in evaluation
        missing = [f"world.{s}_data" for s in needed if not _source(cfg, s)]
        if missing:
            raise ValueError(f"world.base_model is set, so {' and '.join(missing)} must name a problem table"
                             f"{'' if cfg.eval.suites else ' (or set eval.suites)'}")
        return paths
    sizes = {"sft": w.n_sft, "train": w.n_train, "val": w.n_val, "test": w.n_test}
    if w.problems == "gsm_symbolic":
        splits = gsm.generate(cfg.seed, sizes, w.held_out)
    else:
        splits = problems.generate(cfg.seed, sizes, w.kinds)
    for split, key in (("sft", "sft_problems"), ("train", "train"), ("val", "val"), ("test", "test")):
        splits[split].write_parquet(WorldLayout(dir=out).table(key))
    if w.import_model:  # a pretrained model, tool-aware, read through its own template
        importer.bring_in(w.import_model, Path(paths["init_model"]))
        chat = ChatFormat.load(paths["init_model"])
    else:
        chat = ChatFormat.from_template(tokenizer.CHAT_TEMPLATE, tokenizer.SPECIAL_TOKENS, "the tiny world's template")
    opens_reason = chat.prompt("").endswith(REASON_OPEN)
    sft = sft_data.build(splits["sft"], cfg.sft.mix, cfg.seed, cfg.sft.system_prompt_frac, cfg.sft.mix_by_kind,
                         cfg.rollout.tool_response_chars, opens_reason)
    if not cfg.sft.data:
        transcripts.write(sft, paths["sft_data"])
    if not w.import_model:
        corpus = ["".join(text for text, _ in chat.segments(row["messages"])) for row in sft]  # the streams SFT sees
        tok = tokenizer.train(corpus, w.vocab_size, WorldLayout(dir=out).tokenizer, w.digits_per_token)
        model.create(tok, w.hidden, w.layers, w.heads, w.kv_heads, w.ffn, w.max_positions, cfg.seed,
                     Path(paths["init_model"]))
    return paths


def load_split(src: str) -> tuple[pl.DataFrame, dict]:
    """A user's problem table for RL or the world's evaluation split, in any layout `rstar2 data import` reads
    (rstar2/data/formats.py: the problem schema, verl/DAPO chat prompts, GSM8K, problem/solution, problem/answer):
    rows that cannot be read (a missing prompt or answer, a JSONL line that is not an object) and rows whose
    (normalised) answer is not an integer are dropped and counted (the paper's RL filter), never a whole file
    rejected (a row without an id gets `<file stem>-<row>`); a file in no known layout or with repeated ids is one error
    naming the file."""
    table = formats.read(src)
    df = table.rows.filter(pl.col("answer").map_elements(clean.is_integer, return_dtype=pl.Boolean))
    counts = {"rows_in": table.rows_in, "dropped_malformed": len(table.bad),
              "dropped_non_integer": table.rows.height - df.height, "rows_out": df.height, "format": table.format}
    if df.height == 0:
        raise ValueError(f"{src}: no usable problem left ({counts})")
    return schema.validate(df, src), counts


def sync_data(cfg: RunCfg, out: Path) -> dict[str, dict]:
    """Bring each set world.<split>_data into the world as `data-<split>.parquet`, again whenever the source file's
    content changed since (sha256); returns the record of each split brought in by this call (data_sources.json keeps
    every split's: source, sha256, rows in and out, rows dropped as malformed or for a non-integer answer)."""
    files = WorldLayout(dir=out)
    record_path = files.sources
    record = json.loads(record_path.read_text()) if record_path.is_file() else {}
    done: dict[str, dict] = {}
    for split in SPLITS:
        src = _source(cfg, split)
        if not src:
            continue
        digest = file_sha256(src)
        if digest is None:
            raise ValueError(f"world.{split}_data: {src}: no such file")
        dest = files.imported(split)
        if record.get(split, {}).get("sha256") == digest and dest.is_file():
            continue
        df, counts = load_split(src)
        write_atomic(dest, df.write_parquet)
        record[split] = done[split] = {"source": str(Path(src).resolve()), "sha256": digest, **counts}
        write_atomic(record_path, json.dumps(record, indent=1))
    return done
