"""How every `rstar2` command refuses: one line, then its exit code."""

from __future__ import annotations

from typing import NoReturn

import typer
from rich.markup import escape

from rstar2.core import progress

console = progress.console()


def fail(message: object, code: int = 2) -> NoReturn:
    """`error: <message>` on one line (markup in it is shown as written), then exit `code` (2: bad input or usage,
    1: the command ran and its verdict is no)."""
    console.print(f"[red]error:[/red] {escape(str(message))}", soft_wrap=True)
    raise typer.Exit(code)
