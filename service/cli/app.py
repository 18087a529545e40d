"""The ``embcache`` command: ``serve`` here, the operator commands from ``cli/ops.py``."""

from typing import Annotated

import typer

from embcache.service.cli.refusals import SettingSources, refuse
from embcache.service.cli.settings import PlainHelpCommand, with_settings
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


@app.command(cls=PlainHelpCommand, context_settings={"max_content_width": 100})
@with_settings
def serve(settings: Settings, sources: SettingSources) -> None:
    """Run the daemon (gRPC + HTTP) with the given settings; CPU mode without a GPU.

    Every setting is a flag or an EMBCACHE_<NAME> environment variable (a flag wins). Sizes
    take units (4GiB, 256KiB); on|off settings also take true/false, 1/0, yes/no.
    """
    from embcache.service.daemon import serve as run_daemon
    from embcache.service.host.host_pool import PoolInUseError
    from embcache.service.startup import StartupError

    try:
        code = run_daemon(settings)
    except StartupError as exc:
        reason = exc.reason
        if exc.setting is not None:
            reason = f"{sources.describe(exc.setting, exc.value)}: {exc.reason}"
        refuse([reason])
        raise typer.Exit(1) from None
    except (PoolInUseError, OSError) as exc:
        message = str(exc)
        if isinstance(exc, OSError) and exc.filename is None and exc.strerror:
            message = exc.strerror  # without the "[Errno N]" prefix
        refuse([message])
        raise typer.Exit(1) from None
    raise typer.Exit(code)


def _register_operator_commands() -> None:
    try:
        from embcache.service.cli import ops as cli_ops
    except ImportError:  # operator commands not installed in this build
        return
    cli_ops.register(app)


_register_operator_commands()
