"""Stage installed distributions of a Python environment for an image build, where no package index serves the
lock's versions (no registry here, and the machine's local index lacks most of them): each distribution's files, as
its RECORD lists them, are hard-linked (or copied) into OUT, the site-packages tree the Dockerfile copies into its
venv. Both interpreters are CPython 3.11 on glibc, so the compiled extensions carry over.

  python infra/docker/stage_packages.py OUT all                      every distribution (the CPU image)
  python infra/docker/stage_packages.py OUT fastapi math-verify ...  these and what they need (the sandbox image)

Run it with the environment's own interpreter. Left out: pip (the image's venv brings its own), the project itself
(the image installs it from the checkout) and console scripts (they name this environment's interpreter)."""

from __future__ import annotations

import os
import shutil
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

SKIP = {"pip", "rstar2"}


def closure(names: list[str]) -> set[str]:
    """The named distributions and everything they require (markers evaluated here, no extras)."""
    todo, seen = [canonicalize_name(n) for n in names], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for spec in metadata.distribution(name).requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(req.name))
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
    (out / ".staged").write_text(" ".join(sorted(names)) + "\n")
    return count


def main(argv: list[str]) -> None:
    out, names = Path(argv[0]), argv[1:]
    every = {canonicalize_name(d.metadata["Name"]) for d in metadata.distributions()}
    wanted = (every if names == ["all"] else closure(names)) - SKIP
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    print(f"staged {len(wanted)} distributions ({stage(out, wanted)} files) in {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
