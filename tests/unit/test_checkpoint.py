import pytest

from rstar2.core import checkpoint


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


def test_prune_keeps_the_newest_and_held_and_uncommitted(tmp_path):
    for n in range(1, 6):
        checkpoint.commit(tmp_path / f"step-{n:04d}", lambda d: (d / "w").write_text("x"), {"step": n})
    (tmp_path / "step-0006").mkdir()  # uncommitted (a crash before its marker): not a checkpoint, never pruned
    (tmp_path / ".tmp-step-0007-1-2").mkdir()  # a commit in progress
    with checkpoint.hold(tmp_path / "step-0002"):
        gone = checkpoint.prune(tmp_path, 2)
    assert [d.name for d in gone] == ["step-0001", "step-0003"]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [".holds", ".tmp-step-0007-1-2", "step-0002", "step-0004", "step-0005", "step-0006"]
    assert not list((tmp_path / ".holds").iterdir())  # the hold is released on exit
    assert [d.name for d in checkpoint.prune(tmp_path, 2)] == ["step-0002"]  # released: now it goes
    assert checkpoint.prune(tmp_path, None) == [] and checkpoint.prune(tmp_path, 1)[0].name == "step-0004"
    assert [d.name for d in checkpoint.committed(tmp_path)] == ["step-0005"]
