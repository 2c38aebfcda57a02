"""A run's sandboxes: one backend per sandbox config (rstar2.sandbox.backends), connected, or its local service
started, on first use; its warm executors shared by every rollout and reward check of the run, closed at the end."""

from __future__ import annotations

import threading

from rstar2.core.config import SandboxCfg
from rstar2.sandbox.backends import Backend, connect


class Sandboxes:
    def __init__(self):
        self._open: dict[str, Backend] = {}  # by the config's JSON
        self._lock = threading.Lock()  # tasks may ask from several threads at once

    def get(self, cfg: SandboxCfg) -> Backend:
        """The sandbox for `cfg`, connected (or its local service started) on first use."""
        key = cfg.model_dump_json()
        with self._lock:
            if key not in self._open:
                self._open[key] = connect(cfg)
            return self._open[key]

    def close(self) -> None:
        """Close every one; a later `get` starts afresh."""
        with self._lock:
            for sb in self._open.values():
                sb.close()
            self._open = {}
