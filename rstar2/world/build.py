"""Make the whole tiny world under one directory: problem splits, SFT transcripts, tokenizer, initial model."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from rstar2.config import RunCfg
from rstar2.world import model, problems, sft_data, tokenizer


def build(cfg: RunCfg, out: Path) -> dict[str, str]:
    """Returns URIs: train/test/sft problem Parquets, sft transcripts Parquet, init model dir (with tokenizer)."""
    w = cfg.world
    out.mkdir(parents=True, exist_ok=True)
    uris = {k: str(out / f"{k}.parquet") for k in ("sft_problems", "train", "val", "test", "sft_data")}
    uris["init_model"] = str(out / "init_model")
    if w.base_model:  # real assets: nothing to generate but the data checks
        for split, src in (("train", w.train_data), ("val", w.val_data), ("test", w.test_data)):
            if not src and split == "val":
                del uris["val"]  # optional with real assets; asking to evaluate on it then fails clearly
                continue
            if not src:
                raise ValueError(f"world.base_model is set, so world.{split}_data must name a Parquet file")
            problems.validate(pl.read_parquet(src)).write_parquet(uris[split])
        uris["init_model"] = w.base_model
        return uris
    splits = problems.generate(cfg.seed, {"sft": w.n_sft, "train": w.n_train, "val": w.n_val, "test": w.n_test}, w.kinds)
    splits["sft"].write_parquet(uris["sft_problems"])
    splits["train"].write_parquet(uris["train"])
    splits["val"].write_parquet(uris["val"])
    splits["test"].write_parquet(uris["test"])
    sft = sft_data.build(splits["sft"], cfg.sft.mix, cfg.seed, cfg.sft.system_prompt_frac,
                         cfg.sft.mix_by_kind)
    sft.write_parquet(uris["sft_data"])
    corpus = ["".join(t) for t in sft["texts"].to_list()]
    tok = tokenizer.train(corpus, w.vocab_size, out / "tokenizer", w.digits_per_token)
    model.create(tok, w.hidden, w.layers, w.heads, w.kv_heads, w.ffn, w.max_positions, cfg.seed, Path(uris["init_model"]))
    return uris


def eval_split(uris: dict[str, str], split: str) -> str:
    """The Parquet URI evaluation runs on; one clear error when the world lacks that split."""
    if split not in uris:
        raise ValueError(f"eval.split={split!r}, but this world has no {split} split (real assets: set world.{split}_data)")
    return uris[split]
