import pytest

from rstar2 import checkpoint


def test_commit_is_atomic_and_latest_ignores_partial(tmp_path):
    root = tmp_path / "ckpts"
    checkpoint.commit(root / "step-0001", lambda d: (d / "w.bin").write_bytes(b"1"), {"step": 1})

    def crash(d):
        (d / "w.bin").write_bytes(b"half")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        checkpoint.commit(root / "step-0002", crash, {"step": 2})
    assert not (root / "step-0002").exists() and not list(root.glob(".tmp-*"))
    (root / "step-0003").mkdir()  # a directory without the marker is never a checkpoint
    assert checkpoint.latest(root).name == "step-0001"
    assert checkpoint.manifest(root / "step-0001")["step"] == 1
    with pytest.raises(FileExistsError):
        checkpoint.commit(root / "step-0001", lambda d: None, {})
    with pytest.raises(FileNotFoundError):
        checkpoint.manifest(root / "step-0003")


def test_write_atomic_replaces_whole_files_and_leaves_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "result.json"
    checkpoint.write_atomic(path, "old")
    checkpoint.write_atomic(path, "new")
    assert path.read_text() == "new"

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.os, "replace", fail)
    with pytest.raises(OSError):
        checkpoint.write_atomic(path, "partial")
    assert path.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]
