"""`rstar2 serve`'s process handling without starting the servers: a taken port names its holder, and stopping a
process tree leaves nothing behind within the bound, even a child that ignores SIGTERM."""

import os
import socket
import subprocess
import time

import psutil
import pytest

from rstar2.cli import supervisor


def test_a_taken_port_names_the_process_holding_it():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(supervisor.PortInUse, match=rf"port {port} \(mlflow_port\) is already in use by pid "
                                                     rf"{os.getpid()} "):
            supervisor.check_ports(prefect_port=_free_port(), mlflow_port=port)
    supervisor.check_ports(mlflow_port=port)  # free again: no error


def test_stop_tree_leaves_no_descendant_even_one_ignoring_sigterm():
    proc = subprocess.Popen(["bash", "-c", "(trap '' TERM; sleep 300) & sleep 300 & wait"], start_new_session=True)
    deadline = time.monotonic() + 10
    while len(psutil.Process(proc.pid).children(recursive=True)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    procs = supervisor.tree(proc)
    assert len(procs) >= 3
    t0 = time.monotonic()
    supervisor.stop_tree(procs, grace_s=2.0)
    assert time.monotonic() - t0 < 10
    assert not [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    proc.wait(timeout=5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
