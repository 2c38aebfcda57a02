"""Process environment defaults (mirrors infra/env.sh) so `rstar2 ...` run directly also keeps every tool's
state under RSTAR2_HOME, never $HOME, and needs no server. Values the user set win: that is how one scales out."""

from __future__ import annotations

import os
from pathlib import Path


def apply(home: str | None = None) -> Path:
    root = Path(home or os.environ.get("RSTAR2_HOME") or Path.cwd() / ".rstar2").resolve()
    for sub in ("prefect", "vllm", "vllm_rpc", "torch_ext", "hf", "tmp"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    defaults = {
        "RSTAR2_HOME": str(root),
        "PREFECT_HOME": str(root / "prefect"),
        "PREFECT_MEMO_STORE_PATH": str(root / "prefect" / "memo_store.toml"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        # the ephemeral API server's default 20 s start timeout fails on a loaded 2-core machine
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
        "PREFECT_LOGGING_LEVEL": "WARNING",
        "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true",
        "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CACHE_ROOT": str(root / "vllm"),
        "VLLM_RPC_BASE_PATH": str(root / "vllm_rpc"), "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1",
        "VLLM_CONFIGURE_LOGGING": "0",
        "TORCH_EXTENSIONS_DIR": str(root / "torch_ext"),
        "HF_HOME": str(root / "hf"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    for k, v in defaults.items():
        os.environ.setdefault(k, v)
    return root
