"""RSTAR2_HOME has one default, defined in rstar2.cli.env: the variable, else `.rstar2` in the base a caller names
(the checkout, for infra/env.sh and the tests) or the working directory; nothing else falls back to a value of its
own."""

import os
import re
import subprocess
from pathlib import Path

from rstar2.cli import env

ROOT = Path(__file__).resolve().parents[2]
# a fallback for an unset RSTAR2_HOME: `.get("RSTAR2_HOME", x)`, `.get("RSTAR2_HOME") or x`, `${RSTAR2_HOME:-x}`
FALLBACK = re.compile(r"""get\(\s*["']RSTAR2_HOME["']\s*(,|\)\s*or\b)|\$\{RSTAR2_HOME:?[-=]""")


def test_the_variable_else_the_bases_rstar2(tmp_path, monkeypatch):
    monkeypatch.delenv("RSTAR2_HOME", raising=False)
    assert env.home(tmp_path) == tmp_path / ".rstar2"
    monkeypatch.chdir(tmp_path)
    assert env.home() == tmp_path / ".rstar2"
    monkeypatch.setenv("RSTAR2_HOME", str(tmp_path / "state"))
    assert env.home(ROOT) == tmp_path / "state"
    assert env.defaults(env.state_root(ROOT))["PREFECT_HOME"] == str(tmp_path / "state" / "prefect")
    assert (tmp_path / "state" / "ray").is_dir()


def test_the_shell_gets_the_same_default_as_the_tests(tmp_path):
    ours = {*env.defaults(Path("/")), *env.SHELL_ONLY}
    shell = {k: v for k, v in os.environ.items() if k not in ours}  # none of the defaults set yet
    script = f"cd {tmp_path} && source {ROOT}/infra/env.sh && echo $RSTAR2_HOME $PREFECT_HOME"  # started elsewhere
    out = subprocess.run(["bash", "-c", script], env=shell, capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(ROOT / ".rstar2"), str(ROOT / ".rstar2" / "prefect")]
    mine = {**shell, "RSTAR2_HOME": str(tmp_path / "h")}
    out = subprocess.run(["bash", "-c", f"source {ROOT}/infra/env.sh && echo $RSTAR2_HOME"], env=mine,
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(tmp_path / "h")]


def test_no_other_default_for_rstar2_home():
    assert FALLBACK.search('os.environ.get("RSTAR2_HOME", "/tmp/rstar2")')  # what the check finds
    assert FALLBACK.search('os.environ.get("RSTAR2_HOME") or ROOT / ".rstar2"')
    assert FALLBACK.search('export RSTAR2_HOME="${RSTAR2_HOME:-$root/.rstar2}"')
    assert not FALLBACK.search('home = os.environ.get("RSTAR2_HOME")')
    files = [f for d in ("rstar2", "cli", "flows", "tasks", "bench", "tests", "infra", ".ci", "docs")
             for f in sorted((ROOT / d).rglob("*")) if f.is_file() and f.suffix in ("", ".py", ".sh", ".md", ".yaml")]
    found = [f"{f.relative_to(ROOT)}:{i}: {line.strip()}" for f in files if f != ROOT / "cli" / "env.py"
             and f != Path(__file__) for i, line in enumerate(f.read_text(errors="replace").splitlines(), 1)
             if FALLBACK.search(line)]
    assert not found, "a second default of RSTAR2_HOME (rstar2.cli.env.home is the one):\n" + "\n".join(found)
