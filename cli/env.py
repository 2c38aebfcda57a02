"""Process environment defaults, the one definition: every tool's state under RSTAR2_HOME (never $HOME), no hub, no
telemetry, no server needed. `rstar2 ...` applies them in its own process (`apply`); infra/env.sh exports them into
a shell (`python3 cli/env.py` prints the export lines); the tests apply them at collection (tests/conftest.py).
Values the user set win: that is how one scales out (RAY_ADDRESS, PREFECT_API_URL, MLFLOW_TRACKING_URI). The library
reads RSTAR2_HOME from the environment only (rstar2.rollout.cluster: Ray's state), never a default of its own.
Standard library only: the shell runs it with any python3."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

SUBDIRS = ("prefect", "vllm", "vllm_rpc", "torch_ext", "hf", "tmp", "ray")
# RSTAR2_HOME's default, the one: `.rstar2` in the working directory, or in the `base` a caller names (the dev
# scripts and the tests name the repository's root, so a checkout keeps its state beside its sources whatever the
# directory they are started from). The images set RSTAR2_HOME themselves (/var/lib/rstar2).
HOME_DIR = ".rstar2"


def defaults(root: Path) -> dict[str, str]:
    """The variables and their default values for state kept under `root`."""
    return {
        "RSTAR2_HOME": str(root),
        "PREFECT_HOME": str(root / "prefect"),
        "PREFECT_MEMO_STORE_PATH": str(root / "prefect" / "memo_store.toml"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        # the ephemeral API server's default 20 s start timeout fails on a loaded 2-core machine
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
        "PREFECT_LOGGING_LEVEL": "WARNING",
        # the library's loggers reach the flow run's logs in the UI (tasks/__init__.py); a line outside a run stays
        # on the terminal without a warning
        "PREFECT_LOGGING_EXTRA_LOGGERS": "rstar2", "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
        "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true",
        "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CACHE_ROOT": str(root / "vllm"),
        "VLLM_RPC_BASE_PATH": str(root / "vllm_rpc"), "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1",
        "VLLM_CONFIGURE_LOGGING": "0",
        "TORCH_EXTENSIONS_DIR": str(root / "torch_ext"),
        "HF_HOME": str(root / "hf"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


# Exported by the shell only: a shell sets it before anything it starts reads it, while a running Python process has
# already fixed its temporary directory (tempfile caches it) and its sandbox keeps using /tmp.
SHELL_ONLY = {"TMPDIR": "tmp"}


def home(base: str | Path | None = None) -> Path:
    """RSTAR2_HOME: the variable, else `<base>/.rstar2` (`base`: the working directory where not given)."""
    return Path(os.environ.get("RSTAR2_HOME") or Path(base or Path.cwd()) / HOME_DIR).resolve()


def state_root(base: str | Path | None = None) -> Path:
    """RSTAR2_HOME (see `home`), created with its subdirectories."""
    root = home(base)
    for sub in SUBDIRS:
        (root / sub).mkdir(parents=True, exist_ok=True)
    return root


def apply(base: str | Path | None = None) -> Path:
    """Set every default that is not already set in this process; returns RSTAR2_HOME."""
    root = state_root(base)
    for k, v in defaults(root).items():
        os.environ.setdefault(k, v)
    return root


def shell_exports(base: str | Path | None = None) -> str:
    """Bash lines that export every default (SHELL_ONLY too) that is not already set in the calling shell."""
    root = state_root(base)
    values = {**defaults(root), **{k: str(root / sub) for k, sub in SHELL_ONLY.items()}}
    return "\n".join(f'[ -n "${{{k}+set}}" ] || export {k}={shlex.quote(v)}' for k, v in values.items())


if __name__ == "__main__":  # infra/env.sh: eval "$(python3 cli/env.py [BASE])"
    print(shell_exports(sys.argv[1] if len(sys.argv) > 1 else None))
