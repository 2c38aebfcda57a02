"""`rstar2 serve` keeps its servers up (cli/supervisor.py `_supervise`): a server that exits is started again, what is
left of its process group first killed; the worker's exit ends the watch, and so do servers that keep exiting. Real
processes stand in for the servers (a server's own restart on its port and state: tests/serve/test_serve_e2e.py)."""

import os
import signal
import subprocess
import sys
import time

import psutil

from rstar2.cli import supervisor


def _proc(seconds: float) -> subprocess.Popen:
    # a server stand-in with a child of its own in its session, as `prefect server start` has
    code = f"import subprocess, time; subprocess.Popen(['sleep', '{seconds}']); time.sleep({seconds})"
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


def _children(proc: subprocess.Popen, within_s: float = 20.0) -> list[int]:
    """The stand-in's child, once it has started it (a loaded machine took more than the 0.5 s once given)."""
    deadline = time.monotonic() + within_s
    while not (pids := [c.pid for c in supervisor.tree(proc)[1:]]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return pids


def test_a_killed_server_is_started_again_its_group_killed_and_the_worker_ends_the_watch():
    said, started = [], []

    def start():
        started.append(_proc(60))
        return started[-1]

    running = {"Prefect server": start()}
    orphan = _children(running["Prefect server"])
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(4)"])
    os.kill(running["Prefect server"].pid, signal.SIGKILL)  # the leader dies; its child stays in its group
    try:
        assert supervisor._supervise(running, {"Prefect server": start}, worker, said.append) is True
        assert len(started) == 2 and running["Prefect server"] is started[1] and started[1].poll() is None
        assert said[0].startswith("the Prefect server exited (code -9); starting it again (1 of 3)")
        assert orphan and not any(_alive(pid) for pid in orphan)  # killed with its group, nothing holds its port
    finally:
        for p in started:
            supervisor.stop_tree(supervisor.tree(p), 5)


def test_servers_that_keep_exiting_end_the_watch_after_the_restarts():
    said = []
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        running = {"MLflow server": _proc(0)}
        assert supervisor._supervise(running, {"MLflow server": lambda: _proc(0)}, worker, said.append) is False
        assert sum("starting it again" in s for s in said) == supervisor.SERVER_RESTARTS
    finally:
        worker.kill()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
