"""Every Settings field as a CLI flag (``host_pool_bytes`` -> ``--host-pool-bytes``).

Flags override ``EMBCACHE_*`` env vars, which override defaults. Commands decorated with
:func:`with_settings` receive a validated, frozen ``settings`` argument; settings that fail
validation end the command with exit code 2 and one ``cannot start: ...`` line per error
(``refusals.py``). Each flag's help shows its type or unit, default, range and environment
variable, read off the field (``settings_help.py``).
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import typer
from pydantic import ValidationError
from typer.core import TyperCommand

if TYPE_CHECKING:
    from typer._click import Context, HelpFormatter

from embcache.service.cli.refusals import (
    SettingSources,
    flag_name,
    refuse,
    settings_refusals,
)
from embcache.service.cli.settings_help import env_var, metavar, option_help
from embcache.service.config import DEPRECATED_NAMES, Settings

__all__ = ["PlainHelpCommand", "build_settings", "flag_name", "with_settings"]


class PlainHelpCommand(TyperCommand):
    """A command whose ``--help`` is click's plain layout: a flag name is never cut short
    (rich's option table truncates long names at 80 columns) and each help text wraps under
    its flag."""

    def format_help(self, ctx: Context, formatter: HelpFormatter) -> None:
        self.rich_markup_mode = None
        super().format_help(ctx, formatter)


def _log_format(given: dict[str, Any]) -> str:
    """The log format asked for, before the settings are known to be valid."""
    fmt = given.get("log_format") or os.environ.get(env_var("log_format"), "text")
    return "json" if str(fmt).strip().lower() == "json" else "text"


def build_settings(overrides: dict[str, Any], sources: SettingSources | None = None) -> Settings:
    """Settings from env + the flags that were given; exit 2 with one line per bad setting,
    each naming the flag or environment variable that gave the value."""
    given = {k: v for k, v in overrides.items() if v is not None}
    sources = sources or SettingSources(given)
    try:
        return Settings(**given)
    except ValidationError as exc:
        refuse(settings_refusals(exc, sources), _log_format(given))
        raise typer.Exit(2) from None


def with_settings(func: Callable[..., Any]) -> Callable[..., Any]:
    """Add one option per Settings field to a typer command; pass ``settings=`` instead (and
    ``sources=``, where the settings came from, when the command takes it). The command is
    made with ``cls=PlainHelpCommand``: the help texts are plain text, not rich markup."""
    sig = inspect.signature(func, eval_str=True)  # real annotations, even under PEP 563
    wants_sources = "sources" in sig.parameters
    own = [p for name, p in sig.parameters.items() if name not in ("settings", "sources")]
    extra = []
    for name, field in Settings.model_fields.items():
        extra.append(
            inspect.Parameter(
                name,
                inspect.Parameter.KEYWORD_ONLY,
                annotation=str | None,
                default=typer.Option(
                    None,
                    flag_name(name),
                    metavar=metavar(name, field),
                    help=option_help(name, field),
                    show_default=False,  # the help says it, as a flag would take it
                ),
            )
        )

    for old, new in DEPRECATED_NAMES.items():  # hidden, still accepted for one release
        extra.append(
            inspect.Parameter(
                old,
                inspect.Parameter.KEYWORD_ONLY,
                annotation=str | None,
                default=typer.Option(None, flag_name(old), hidden=True, help=f"{flag_name(new)}"),
            )
        )

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        overrides = {name: kwargs.pop(name) for name in Settings.model_fields}
        for old in DEPRECATED_NAMES:
            overrides[old] = kwargs.pop(old)
        sources = SettingSources({k: v for k, v in overrides.items() if v is not None})
        if wants_sources:
            kwargs["sources"] = sources
        return func(*args, settings=build_settings(overrides, sources), **kwargs)

    wrapper.__signature__ = sig.replace(parameters=own + extra)  # type: ignore[attr-defined]
    return wrapper
