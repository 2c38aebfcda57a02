"""The one atomic writer of the project: checkpoints, directories and single files. Write into a temporary sibling,
fsync it (every file, every directory inside), rename it into place, then fsync the parent directory, so that what a
commit reported survives a power cut too. A directory is a checkpoint only if it holds COMMITTED.json (written last,
inside the temp dir, before the rename), so a crash at any point leaves either the previous checkpoint or a `.tmp-*`
directory that nothing mistakes for a valid one. Single files (a finished evaluation's result, a world's table) are
written the same way by `write_atomic`. `sha256` is the files' checksum, read in blocks (shards are many GB)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable

from rstar2.core.layout import STEP_PREFIX

MARKER = "COMMITTED.json"


CHUNK = 4 << 20  # bytes a checksum reads at once


def sha256(path: Path) -> str:
    """A file's SHA-256, read in CHUNK blocks (a multi-GB shard is never whole in memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    """Flush a file's data, or a directory's entries, to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """Every file and directory under `root`, deepest first, then `root` itself."""
    for p in sorted(root.rglob("*"), key=lambda p: -len(p.parts)):
        if p.is_file() or p.is_dir():
            _fsync(p)
    _fsync(root)


def _digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): sha256(p)[:16]
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != MARKER}


def commit(final_dir: Path, write: Callable[[Path], None], meta: dict) -> Path:
    """Run `write(tmp_dir)`, seal it with a manifest, and atomically rename it to `final_dir`."""
    final_dir = Path(final_dir)
    if is_committed(final_dir):
        raise FileExistsError(f"checkpoint {final_dir} is already committed")

    def sealed(tmp: Path) -> None:
        write(tmp)
        (tmp / MARKER).write_text(json.dumps({**meta, "files": _digest(tmp), "committed_at": time.time()}, indent=1))

    return write_dir_atomic(final_dir, sealed)


def require_new(out: Path, what: str) -> None:
    """`out` may be written as a new directory (absent, or empty); else FileExistsError naming it and `what` writes."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not empty: {what} writes a new directory")


def write_dir_atomic(final_dir: Path, write: Callable[[Path], None]) -> Path:
    """Run `write(tmp_dir)` in a temporary sibling of `final_dir`, fsync it, rename it to `final_dir` (which it
    replaces if present) and fsync their parent (and the parent of each directory above made for it): readers see the
    whole directory or none of it, after a power cut too."""
    final_dir = Path(final_dir)
    made = [d for d in final_dir.parents if not d.exists()]  # what mkdir(parents=True) makes, nearest first
    tmp = final_dir.with_name(f".tmp-{final_dir.name}-{os.getpid()}-{time.time_ns()}")
    tmp.mkdir(parents=True)
    try:
        write(tmp)
        _fsync_tree(tmp)
        if final_dir.exists():  # e.g. an uncommitted leftover with a checkpoint's name: never valid, replace it
            shutil.rmtree(final_dir)
        os.rename(tmp, final_dir)
        for d in (final_dir, *made):
            _fsync(d.parent)
    except BaseException as e:
        full = _out_of_space(e, tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        if full:
            raise DiskFull(errno.ENOSPC, f"{final_dir}: the disk filled up while it was written "
                           f"({shutil.disk_usage(final_dir.parent).free / 2**20:.0f} MB free with the partial "
                           "write removed); nothing was committed: free space and retry, the run resumes from its "
                           "last committed checkpoint") from e
        raise
    return final_dir


class DiskFull(OSError):
    """A directory could not be written for lack of space; nothing of it was left behind."""


def _out_of_space(e: BaseException, where: Path) -> bool:
    """Whether `e` came from a full disk: an ENOSPC/EDQUOT OSError anywhere in its chain, or its text
    (safetensors reports the OS error in its message). torch.save's RuntimeError carries neither, so any error with
    under 1 MB left where it was writing counts too."""
    full = {os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT)}
    seen = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(text in str(seen) for text in full):
            return True
        seen = seen.__cause__ or seen.__context__
    try:
        return isinstance(e, Exception) and shutil.disk_usage(where).free < 2**20
    except OSError:
        return False


def write_atomic(path: Path, content: str | Callable[[Path], object]) -> Path:
    """Write one file so that readers see the old content or the new, never a part, after a power cut too: a temporary
    sibling, fsync, rename over `path`, fsync of the parent. `content`: the text, or a writer that writes the file at
    the path it is given (e.g. a frame's `write_parquet`)."""
    path = Path(path)
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}-{time.time_ns()}")
    try:
        if callable(content):
            content(tmp)
        else:
            tmp.write_text(content)
        _fsync(tmp)
        os.replace(tmp, path)
        _fsync(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def is_committed(d: Path) -> bool:
    return (Path(d) / MARKER).is_file()


def manifest(d: Path) -> dict:
    if not is_committed(d):
        raise FileNotFoundError(f"{d} is not a committed checkpoint (no {MARKER})")
    return json.loads((Path(d) / MARKER).read_text())


def committed(root: Path, prefix: str = STEP_PREFIX) -> list[Path]:
    """The committed checkpoints under `root`, in step order (by the number in the name)."""
    root = Path(root)
    found = [d for d in root.glob(f"{prefix}*") if d.is_dir() and is_committed(d)] if root.is_dir() else []
    return sorted(found, key=lambda d: int(d.name[len(prefix):]))


def latest(root: Path, prefix: str = STEP_PREFIX) -> Path | None:
    """The newest committed checkpoint under `root` (by step number in the name), or None."""
    found = committed(root, prefix)
    return found[-1] if found else None


HOLDS = ".holds"


@contextlib.contextmanager
def hold(ckpt_dir: Path):
    """While inside, `prune` leaves `ckpt_dir` alone (an evaluation reading it). A marker file beside the
    checkpoints, one per holder; a holder killed without cleanup leaves its marker, which errs on keeping."""
    ckpt_dir = Path(ckpt_dir)
    marker = ckpt_dir.parent / HOLDS / f"{ckpt_dir.name}.{os.getpid()}-{time.time_ns()}"
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
    try:
        yield ckpt_dir
    finally:
        marker.unlink(missing_ok=True)


def sweep(root: Path, prefix: str = STEP_PREFIX) -> list[Path]:
    """Delete what dead writers left under `root`: `.tmp-<name>-<pid>-<ns>` directories whose process is gone (a
    commit killed mid-write) and uncommitted `<prefix>*` directories (a prune killed mid-delete). A resumed run calls
    it before it writes again; a live writer's temporary directory stays. Returns what was deleted."""
    root = Path(root)
    if not root.is_dir():
        return []
    gone = []
    for d in root.iterdir():
        if not d.is_dir():
            continue
        pid = d.name.rsplit("-", 2)[-2] if d.name.startswith(".tmp-") and d.name.count("-") >= 3 else None
        dead_tmp = pid is not None and pid.isdigit() and not _alive(int(pid))
        if dead_tmp or (d.name.startswith(prefix) and not is_committed(d)):
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d)
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def prune(root: Path, keep_last: int | None, prefix: str = STEP_PREFIX) -> list[Path]:
    """Delete the committed checkpoints under `root` older than its newest `keep_last`, except held ones (`hold`);
    returns what was deleted. Uncommitted `.tmp-*` directories are not touched (a commit may be writing one)."""
    if not keep_last:
        return []
    holds = Path(root) / HOLDS
    held = {p.name.rsplit(".", 1)[0] for p in holds.iterdir()} if holds.is_dir() else set()
    old = [d for d in committed(root, prefix)[:-keep_last] if d.name not in held]
    for d in old:
        (d / MARKER).unlink()  # first: a crash mid-delete leaves a directory nothing takes for a checkpoint
        shutil.rmtree(d)
    return old
