"""A disk that fills up while a checkpoint is written (a 4 MB tmpfs made for the test): the commit fails with one
error naming the checkpoint and the disk, leaves no partial directory, keeps the previous checkpoint intact, and
succeeds once there is room. The same through torch.save, which wraps the OSError in a RuntimeError."""

import subprocess

import pytest

from rstar2.core import checkpoint


@pytest.fixture()
def small_disk(tmp_path):
    d = tmp_path / "small"
    d.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(d)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    yield d
    subprocess.run(["umount", str(d)], check=True)


def _write(mb: float):
    return lambda tmp: (tmp / "weights.bin").write_bytes(b"\0" * int(mb * 2**20))


def test_a_checkpoint_that_fills_the_disk_is_refused_whole_and_the_previous_one_stays(small_disk):
    root = small_disk / "checkpoints"
    first = checkpoint.commit(root / "step-0001", _write(1), {"step": 1})
    with pytest.raises(checkpoint.DiskFull, match=r"step-0002: the disk filled up .* nothing was committed"):
        checkpoint.commit(root / "step-0002", _write(8), {"step": 2})
    assert [p.name for p in root.iterdir()] == ["step-0001"]  # no partial or temporary directory left
    assert checkpoint.latest(root) == first and checkpoint.manifest(first)["step"] == 1
    (first / "weights.bin").unlink()  # room again: the retry commits
    assert checkpoint.is_committed(checkpoint.commit(root / "step-0002", _write(1), {"step": 2}))


def test_torch_save_on_a_full_disk_is_the_same_one_error(small_disk):
    import torch

    def torch_writer(tmp):
        torch.save({"w": torch.zeros(2**21)}, tmp / "trainer_state.pt")  # 8 MB through torch's own writer

    with pytest.raises(checkpoint.DiskFull, match="step-0001"):
        checkpoint.commit(small_disk / "step-0001", torch_writer, {})
    assert list(small_disk.iterdir()) == []


def test_a_full_disk_is_recognised_through_wrapping_errors_and_nothing_else_is(tmp_path):
    import errno
    import os

    def wrapped(inner: BaseException) -> RuntimeError:
        try:
            try:
                raise inner
            except BaseException as e:
                raise RuntimeError("writer failed") from e
        except RuntimeError as outer:
            return outer

    assert checkpoint._out_of_space(wrapped(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))), tmp_path)
    # safetensors names the OS error only in its text
    text = f"IoError(Os {{ code: 28, message: \"{os.strerror(errno.ENOSPC)}\" }})"
    assert checkpoint._out_of_space(RuntimeError(text), tmp_path)
    assert not checkpoint._out_of_space(wrapped(OSError(errno.EACCES, os.strerror(errno.EACCES))), tmp_path)
    assert not checkpoint._out_of_space(ValueError("bad shape"), tmp_path)  # this disk has room


def test_a_resumed_run_sweeps_what_dead_writers_left_and_keeps_the_rest(tmp_path):
    import os

    root = tmp_path / "checkpoints"
    kept = checkpoint.commit(root / "step-0001", _write(0.001), {"step": 1})
    dead = subprocess.Popen(["true"])
    dead.wait()
    left = [root / f".tmp-step-0002-{dead.pid}-123", root / "step-0000"]  # killed mid-commit; mid-prune (no manifest)
    live = root / f".tmp-step-0002-{os.getpid()}-456"  # a commit being written now
    for d in left + [live]:
        d.mkdir()
    assert sorted(checkpoint.sweep(root)) == sorted(left)
    assert sorted(p.name for p in root.iterdir()) == sorted([kept.name, live.name])
