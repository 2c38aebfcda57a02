"""Make the whole tiny world under one directory: problem splits, SFT transcripts, tokenizer, initial model."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from rstar2 import transcripts
from rstar2.chat import ChatFormat
from rstar2.config import RunCfg
from rstar2.world import model, problems, sft_data, tokenizer


def uris(cfg: RunCfg, out: Path) -> dict[str, str]:
    """Where a world built under `out` keeps its parts: problem splits, SFT transcripts, init model (+ tokenizer)."""
    w = cfg.world
    found = {k: str(out / f"{k}.parquet") for k in ("sft_problems", "train", "val", "test")}
    found["sft_data"] = cfg.sft.data or str(out / "sft_data.jsonl")
    found["init_model"] = w.base_model or str(out / "init_model")
    if w.base_model and not w.val_data:
        del found["val"]  # optional with real assets; asking to evaluate on it then fails clearly
    return found


def build(cfg: RunCfg, out: Path) -> dict[str, str]:
    """Make the world under `out`; returns its URIs (see `uris`)."""
    w = cfg.world
    out.mkdir(parents=True, exist_ok=True)
    paths = uris(cfg, out)
    if w.base_model:  # real assets: nothing to generate but the data checks
        for split, src in (("train", w.train_data), ("val", w.val_data), ("test", w.test_data)):
            if not src and split == "val":
                continue
            if not src:
                raise ValueError(f"world.base_model is set, so world.{split}_data must name a Parquet file")
            problems.validate(pl.read_parquet(src)).write_parquet(paths[split])
        return paths
    splits = problems.generate(cfg.seed, {"sft": w.n_sft, "train": w.n_train, "val": w.n_val, "test": w.n_test}, w.kinds)
    for split, key in (("sft", "sft_problems"), ("train", "train"), ("val", "val"), ("test", "test")):
        splits[split].write_parquet(paths[key])
    sft = sft_data.build(splits["sft"], cfg.sft.mix, cfg.seed, cfg.sft.system_prompt_frac, cfg.sft.mix_by_kind)
    if not cfg.sft.data:
        transcripts.write(sft, paths["sft_data"])
    chat = ChatFormat.from_template(tokenizer.CHAT_TEMPLATE, tokenizer.SPECIAL_TOKENS, "the tiny world's template")
    corpus = ["".join(text for text, _ in chat.segments(row["messages"])) for row in sft]  # the streams SFT sees
    tok = tokenizer.train(corpus, w.vocab_size, out / "tokenizer", w.digits_per_token)
    model.create(tok, w.hidden, w.layers, w.heads, w.kv_heads, w.ffn, w.max_positions, cfg.seed, Path(paths["init_model"]))
    return paths


def eval_split(uris: dict[str, str], split: str) -> str:
    """The Parquet URI evaluation runs on; one clear error when the world lacks that split."""
    if split not in uris:
        raise ValueError(f"eval.split={split!r}, but this world has no {split} split (real assets: set world.{split}_data)")
    return uris[split]
