"""The ``embcache`` command: ``serve`` here, the operator commands from ``cli/ops.py``."""

import logging
from typing import Annotated

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


def _print_version(value: bool) -> None:
    if value:
        from embcache import build_info

        typer.echo(f"embcache {build_info.describe()}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_print_version,
            is_eager=True,
            help="Print the version and commit, and exit.",
        ),
    ] = False,
) -> None:
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
