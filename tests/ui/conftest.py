"""Shared by the UI tests: headless Debian Chromium, free ports, the screenshot folder."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.ports import free_port as _free_port

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _chromium(url: str, *args: str) -> str:
    """Load `url` headless (SPAs get 25 s of virtual time to render); returns stdout (the DOM with --dump-dom)."""
    done = subprocess.run([CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--window-size=1600,1000", "--virtual-time-budget=25000", *args, url],
                          capture_output=True, text=True, timeout=180)
    return done.stdout


@pytest.fixture(scope="session")
def free_port():
    return _free_port


@pytest.fixture(scope="session")
def chromium():
    if not CHROMIUM:
        pytest.fail("chromium is not installed: run `bash infra/dev.sh ui-test`, which installs it")
    return _chromium


@pytest.fixture(scope="session")
def shots() -> Path:
    d = Path(os.environ.get("RSTAR2_UI_SHOTS", ROOT / ".rstar2" / "ui-shots"))
    d.mkdir(parents=True, exist_ok=True)
    return d
