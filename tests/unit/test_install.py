"""Installing the project claims one import name, `rstar2`: a wheel built from the sources holds the library and the
app floors (cli/, flows/, tasks/, bench/ of the repository as rstar2.cli, ...), and no top-level module of their
names that would shadow, or be shadowed by, another package in a user's environment."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "rstar2", "cli", "flows", "tasks", "bench")


def test_a_wheel_installs_one_top_level_name(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        f = ROOT / name
        if f.is_dir():
            shutil.copytree(f, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(f, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(tmp_path / "dist"), str(src)], check=True, capture_output=True)
    wheel = next((tmp_path / "dist").glob("rstar2-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"rstar2"}
    for floor in ("cli/main.py", "cli/chaos/runner.py", "flows/campaign.py", "tasks/rl.py", "bench/rollout_sim.py",
                  "core/layout.py", "run/controller.py", "presets/tiny.yaml"):
        assert f"rstar2/{floor}" in names
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "rstar2 = rstar2.cli.main:app" in zipfile.ZipFile(wheel).read(entry).decode()
