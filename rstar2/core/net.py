"""A free TCP port of this machine (the OS picks one, the socket is closed before it is used)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """host "" checks every interface (a port other nodes connect to), "127.0.0.1" this machine's loopback."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
