"""Shared by the UI tests: headless Debian Chromium, free ports, the screenshot folder."""

import os
import random
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _free_port() -> int:
    """A port nothing listens on, drawn between Ray's worker ports (10002-19999) and the kernel's ephemeral range. A
    port the kernel hands out (bind to 0, then release) races with every outgoing connection, which takes its local
    port from that range: on a busy machine the MLflow server found its port taken by the time it bound it."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(200):
        port = random.randrange(20000, max(low, 20001))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in 20000-{low - 1}")


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
