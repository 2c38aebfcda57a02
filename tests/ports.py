"""Ports for servers that tests start."""

import random
import socket
from pathlib import Path


def free_port() -> int:
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
