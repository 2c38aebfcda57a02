"""The user's problem tables in a run's world (world.train_data / val_data / test_data): used whenever set (also with
the tiny model), Parquet or JSONL, non-integer answers and malformed rows dropped and counted (never the whole file
refused), and brought in again when the source's content changed."""

import json
import os

import polars as pl
import pytest

from rstar2.core import config
from rstar2.world import build


def _cfg(tmp_path, **data):
    return config.load("tiny", [f"world.{k}_data={v}" for k, v in data.items()] + [f"out_dir={tmp_path}"])


def test_own_data_with_the_tiny_model_is_used_and_filtered(tmp_path):
    src = tmp_path / "train.jsonl"
    rows = [{"problem_id": "a", "prompt": "1+1?", "answer": 2}, {"problem_id": "b", "prompt": "half?", "answer": "1/2"},
            {"problem_id": "c", "prompt": "", "answer": "3"},
            {"problem_id": "d", "prompt": "x?", "answer": "\\boxed{07}"}]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows) + "[not an object]\n")
    cfg, world = _cfg(tmp_path, train=src), tmp_path / "world"
    world.mkdir()
    record = build.sync_data(cfg, world)
    uris = build.uris(cfg, world)
    assert uris["train"] == str(world / "data-train.parquet") and uris["test"] == str(world / "test.parquet")
    assert uris["init_model"] == str(world / "init_model")  # the tiny model is still made by the world
    df = pl.read_parquet(uris["train"])
    assert dict(zip(df["problem_id"], df["answer"])) == {"a": "2", "d": "7"}
    assert {k: record["train"][k] for k in ("rows_in", "dropped_malformed", "dropped_non_integer", "rows_out")} == {
        "rows_in": 5, "dropped_malformed": 2, "dropped_non_integer": 1, "rows_out": 2}


def test_a_changed_source_is_brought_in_again_and_an_unchanged_one_is_not(tmp_path):
    src = tmp_path / "test.parquet"
    pl.DataFrame({"problem_id": ["a"], "prompt": ["p"], "answer": ["1"]}).write_parquet(src)
    cfg, world = _cfg(tmp_path, test=src), tmp_path / "world"
    world.mkdir()
    build.sync_data(cfg, world)
    dest = world / "data-test.parquet"
    os.utime(dest, (1, 1))
    assert build.sync_data(cfg, world) == {} and dest.stat().st_mtime == 1  # same content: not copied again
    pl.DataFrame({"problem_id": ["a", "b"], "prompt": ["p", "q"], "answer": ["1", "2"]}).write_parquet(src)
    record = build.sync_data(cfg, world)
    assert pl.read_parquet(dest)["problem_id"].to_list() == ["a", "b"] and record["test"]["rows_out"] == 2
    assert json.loads((world / "data_sources.json").read_text())["test"] == record["test"]


def test_bad_sources_are_one_clear_error(tmp_path):
    world = tmp_path / "world"
    world.mkdir()
    src = tmp_path / "t.parquet"
    pl.DataFrame({"problem_id": ["a"], "text": ["p"], "answer": ["1"]}).write_parquet(src)  # no problem column
    with pytest.raises(ValueError, match=r"t\.parquet: no known problem layout in columns \['problem_id', 'text'"):
        build.sync_data(_cfg(tmp_path, train=src), world)
    with pytest.raises(ValueError, match=r"world.val_data: .*nope\.jsonl: no such file"):
        build.sync_data(_cfg(tmp_path, val=tmp_path / "nope.jsonl"), world)
    pl.DataFrame({"problem_id": ["a", "a"], "prompt": ["p", "q"], "answer": ["1", "2"]}).write_parquet(src)
    with pytest.raises(ValueError, match=r"t\.parquet: problem_id values are not unique, e\.g\. \['a'\]"):
        build.sync_data(_cfg(tmp_path, train=src), world)
    real = [f"world.base_model={tmp_path}", f"world.train_data={src}", "sft.enabled=false"]
    with pytest.raises(ValueError, match=r"world.test_data must name a problem table \(or set eval.suites\)"):
        build.build(config.load("tiny", real), world)
    with_suites = config.load("tiny", real + ["eval.suites=[{name: a, path: a.jsonl}]"])
    assert "test" not in build.build(with_suites, world) and "val" not in build.uris(with_suites, world)
