import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rstar2.cli import env  # noqa: E402

env.apply(os.environ.get("RSTAR2_HOME") or str(ROOT / ".rstar2"))


@pytest.fixture(scope="session")
def qwen_model_dir(tmp_path_factory) -> Path:
    """The Qwen-shaped model of tests/fixtures/qwen.py (tokenizer, chat template, random Qwen3), made once a session."""
    from tests.fixtures.qwen import make_qwen_model

    return make_qwen_model(tmp_path_factory.mktemp("qwen"))
