"""Commits survive a power cut: the one atomic writer (rstar2.core.checkpoint) fsyncs every file and directory it
wrote before the rename and the parent directory after it; nothing else in the project renames a file into place;
checksums are read in blocks."""

import ast
import hashlib
import os
import tracemalloc
from pathlib import Path

import pytest

from rstar2.core import checkpoint

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("rstar2", "tasks", "flows", "cli", "bench")


@pytest.fixture
def events(monkeypatch):
    """Every fsync (by the path its descriptor was opened on), rename and replace, in order."""
    seen: list[tuple] = []
    opened: dict[int, Path] = {}
    real_open, real_fsync, real_rename, real_replace = os.open, os.fsync, os.rename, os.replace

    def open_(path, flags, *a, **k):
        fd = real_open(path, flags, *a, **k)
        opened[fd] = Path(path) if not k.get("dir_fd") else Path("?")
        return fd

    def fsync(fd):
        seen.append(("fsync", opened[fd]))
        real_fsync(fd)

    def move(kind, real):
        def f(src, dst):
            seen.append((kind, Path(src), Path(dst)))
            real(src, dst)
        return f

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", move("rename", real_rename))
    monkeypatch.setattr(os, "replace", move("replace", real_replace))
    return seen


def _write(d: Path) -> None:
    (d / "shards").mkdir()
    (d / "shards" / "model-1.bin").write_bytes(b"\x01" * 100)
    (d / "config.json").write_text("{}")


def test_a_checkpoint_is_fsynced_whole_before_its_rename_and_its_parents_after(tmp_path, events):
    final = tmp_path / "checkpoints" / "step-0001"
    checkpoint.commit(final, _write, {"step": 1})
    [(i, tmp)] = [(i, e[1]) for i, e in enumerate(events) if e[0] == "rename"]
    assert events[i][2] == final
    before = [e[1] for e in events[:i] if e[0] == "fsync"]
    written = {tmp, tmp / "shards", tmp / "shards" / "model-1.bin", tmp / "config.json", tmp / checkpoint.MARKER}
    assert set(before) == written
    assert before[-1] == tmp  # the directory's entries after everything in it
    assert before.index(tmp / "shards" / "model-1.bin") < before.index(tmp / "shards")
    assert events[i + 1:] == [("fsync", final.parent), ("fsync", tmp_path)]  # checkpoints/ was made for it
    assert checkpoint.is_committed(final) and not tmp.exists()
    events.clear()
    checkpoint.commit(final.with_name("step-0002"), _write, {"step": 2})
    [i] = [i for i, e in enumerate(events) if e[0] == "rename"]
    assert events[i + 1:] == [("fsync", final.parent)]  # the directory was there already


def test_a_single_file_is_fsynced_before_its_replace_and_its_directory_after(tmp_path, events):
    path = tmp_path / "fit.json"
    checkpoint.write_atomic(path, "{}")
    [(kind, tmp)] = [e[:2] for e in events if e[0] == "fsync"][:1]
    assert events == [("fsync", tmp), ("replace", tmp, path), ("fsync", tmp_path)]
    assert tmp.parent == tmp_path and tmp.name.startswith(".tmp-fit.json-") and path.read_text() == "{}"


def test_a_world_table_and_the_preflights_kept_rows_are_written_by_the_atomic_writer(tmp_path, events):
    """The writer's `content` may be a frame's write_parquet (as rstar2.world.build and rstar2.run.preflight pass)."""
    import polars as pl

    df = pl.DataFrame({"problem_id": ["a", "b"], "answer": ["1", "2"]})
    path = tmp_path / "data-train.parquet"
    checkpoint.write_atomic(path, df.write_parquet)
    assert [e[0] for e in events] == ["fsync", "replace", "fsync"] and events[-1] == ("fsync", tmp_path)
    assert pl.read_parquet(path).equals(df)


def _renames(tree: ast.AST) -> list[tuple[int, str]]:
    """os.rename/os.replace/shutil.move calls, and `x.rename(y)`/`x.replace(y)` with one non-literal argument (a
    path's rename; str.replace takes two, polars' rename a mapping)."""
    found = []
    for n in ast.walk(tree):
        if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)):
            continue
        module = isinstance(n.func.value, ast.Name) and n.func.value.id in ("os", "shutil")
        if module and n.func.attr in ("rename", "replace", "renames", "move") or \
                n.func.attr in ("rename", "replace") and len(n.args) == 1 and not n.keywords and \
                not isinstance(n.args[0], (ast.Dict, ast.Constant)):
            found.append((n.lineno, ast.unparse(n)))
    return found


def test_nothing_renames_a_file_into_place_but_the_atomic_writer():
    writer = ROOT / "rstar2" / "core" / "checkpoint.py"
    assert len(_renames(ast.parse(writer.read_text()))) == 2  # the finder sees the writer's own rename and replace
    files = [f for folder in FOLDERS for f in sorted((ROOT / folder).rglob("*.py")) if f != writer]
    found = [f"{f.relative_to(ROOT)}:{line}: {call}"
             for f in files for line, call in _renames(ast.parse(f.read_text()))]
    assert not found, "renames outside rstar2/core/checkpoint.py (use write_atomic / write_dir_atomic):\n" + \
        "\n".join(found)


def test_the_checksum_is_streamed_and_is_sha256(tmp_path):
    assert checkpoint.sha256(_file(tmp_path / "abc", b"abc")) == \
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"  # FIPS 180-2's example
    data = os.urandom(8 * checkpoint.CHUNK + 123)
    big = _file(tmp_path / "shard.bin", data)
    tracemalloc.start()
    try:
        digest = checkpoint.sha256(big)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert digest == hashlib.sha256(data).hexdigest()
    assert peak < 3 * checkpoint.CHUNK < len(data) / 2  # a block or two at a time, never the file


def test_a_checkpoints_manifest_holds_each_files_checksum(tmp_path):
    d = checkpoint.commit(tmp_path / "step-0001", _write, {"step": 1})
    assert checkpoint.manifest(d)["files"] == {
        "config.json": hashlib.sha256(b"{}").hexdigest()[:16],
        "shards/model-1.bin": hashlib.sha256(b"\x01" * 100).hexdigest()[:16]}


def _file(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path
