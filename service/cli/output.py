"""Where the operator commands write: tables and results on stdout, errors on stderr."""

from __future__ import annotations

import typer
from rich.console import Console

console = Console()
err_console = Console(stderr=True, soft_wrap=True)  # one message, one line (never cut)


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print ``message`` as an error; the exit to raise (``raise fail(...)``)."""
    err_console.print(f"[bold red]error:[/] {message}", highlight=False)
    return typer.Exit(code)
