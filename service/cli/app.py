"""The ``embcache`` command: ``serve`` here, operator commands from :mod:`cli_ops`."""

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
    from embcache.service.startup import StartupError

    try:
        code = run_daemon(settings)
    except (StartupError, PoolInUseError, OSError) as exc:
        message = str(exc)
        if isinstance(exc, OSError) and exc.filename is None and exc.strerror:
            message = exc.strerror  # without the "[Errno N]" prefix
        logging.getLogger("embcache").error("cannot start: %s", message)
        raise typer.Exit(1) from None
    raise typer.Exit(code)


def _register_operator_commands() -> None:
    try:
        from embcache.service.cli import ops as cli_ops
    except ImportError:  # operator commands not installed in this build
        return
    cli_ops.register(app)


_register_operator_commands()
