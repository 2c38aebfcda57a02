"""The suite's file order, from measured times: `bash infra/dev.sh test` runs on a worker more than the cores, a file
at a time (pytest-xdist's loadfile, in collection order), so the longest files go first and no worker is left with
one of them at the end. Every whole-suite run records each file's seconds (setup, call and teardown of its tests, beside
the other worker) in this host's `$RSTAR2_HOME/test-durations.json`, and the next run orders by them; a host that has
not run the suite yet orders by `tests/durations.json`, a copy of such a record committed with the tests (from a fresh
clone, whose first run also converts the test models and fills the caches). A file neither knows goes after the
measured ones, end-to-end files first."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parent
COMMITTED = TESTS / "durations.json"
_seconds: dict[str, float] = defaultdict(float)


def local_record() -> Path:
    from rstar2.cli import env

    return env.home(TESTS.parent) / "test-durations.json"


def measured() -> dict[str, float]:
    """Seconds per test file (relative to tests/): this host's last whole run, else the committed record."""
    for path in (local_record(), COMMITTED):
        try:
            return {k: float(v) for k, v in json.loads(path.read_text()).items()}
        except (OSError, ValueError, AttributeError):
            continue
    return {}


def key(item, seconds: dict[str, float], e2e: bool) -> tuple:
    rel = item.path.relative_to(TESTS).as_posix()
    return -seconds.get(rel, 0.0), not e2e


def pytest_runtest_logreport(report) -> None:
    _seconds[report.nodeid.split("::", 1)[0].removeprefix("tests/")] += report.duration


def pytest_sessionfinish(session, exitstatus) -> None:
    """A whole run (no paths, -k or -m chosen; not an xdist worker) that ran to its end, passed or with failures,
    records its files' seconds."""
    cfg = session.config
    whole = not cfg.getoption("keyword") and not cfg.getoption("markexpr") and \
        [Path(a).resolve() for a in cfg.args] in ([], [TESTS], [TESTS.parent])
    if hasattr(cfg, "workerinput") or exitstatus not in (0, 1) or not whole or not _seconds:
        return
    path = local_record()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({k: round(v, 1) for k, v in sorted(_seconds.items(), key=lambda kv: -kv[1])}, indent=1))
    tmp.replace(path)
