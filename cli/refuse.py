"""How every `rstar2` command refuses: one line, then its exit code."""

from __future__ import annotations

from typing import NoReturn

import typer
from rich.markup import escape

from rstar2.cli.output import console
from rstar2.core import config


def fail(message: object, code: int = 2) -> NoReturn:
    """`error: <message>` on one line (markup in it is shown as written), then exit `code` (2: bad input or usage,
    1: the command ran and its verdict is no)."""
    console.print(f"[red]error:[/red] {escape(str(message))}", soft_wrap=True)
    raise typer.Exit(code)


def check_preset(preset: str, overrides: list[str]) -> None:
    """Fail fast, with one clear message, before anything starts: the preset loads and its plan fits."""
    from rstar2.run import plan  # torch and the model catalogue: loaded when a command runs, not for --help

    try:
        plan.require_fit(config.load(preset, overrides))
    except Exception as e:  # noqa: BLE001 - shown to the user as one line
        fail(e)
