"""The ``embcache`` command: ``serve`` here, the operator commands from ``cli/ops.py``."""

from __future__ import annotations

import logging

import typer

from embcache.service.cli.settings import with_settings
from embcache.service.config import Settings

app = typer.Typer(
    name="embcache",
    help="GPU embedding cache for disaggregated multimodal serving.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _main() -> None:
    """GPU embedding cache for disaggregated multimodal serving."""


@app.command()
@with_settings
def serve(settings: Settings) -> None:
    """Run the daemon (gRPC + HTTP) with the given settings; CPU mode without a GPU."""
    from embcache.service.daemon import serve as run_daemon
    from embcache.service.host.host_pool import PoolInUseError

    try:
        code = run_daemon(settings)
    except (PoolInUseError, OSError) as exc:
        logging.getLogger("embcache").error("cannot start: %s", exc)
        raise typer.Exit(1) from None
    raise typer.Exit(code)


def _register_operator_commands() -> None:
    try:
        from embcache.service.cli import ops as cli_ops
    except ImportError:  # operator commands not installed in this build
        return
    cli_ops.register(app)


_register_operator_commands()
