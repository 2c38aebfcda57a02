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
