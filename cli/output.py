"""How every `rstar2` command reports: its tables and lines on one console, its figures as JSON with --json PATH."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from rstar2.core import progress

console = progress.console()


def write_json(path: Optional[Path], data: dict) -> None:
    """Write `data` to `path` (its folder made) and say so; nothing without a path."""
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1))
        console.print(f"wrote {path}")
