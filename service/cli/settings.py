"""Every Settings field as a CLI flag (``host_pool_bytes`` -> ``--host-pool-bytes``).

Flags override ``EMBCACHE_*`` env vars, which override defaults. Commands decorated with
:func:`with_settings` receive a validated, frozen ``settings`` argument.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import typer
from pydantic import ValidationError
from rich.markup import escape

from embcache.service.config import DEPRECATED_NAMES, Settings


def flag_name(field: str) -> str:
    """The flag of a Settings field: ``host_pool_bytes`` -> ``--host-pool-bytes``."""
    return "--" + field.replace("_", "-")


def build_settings(overrides: dict[str, Any]) -> Settings:
    """Settings from env + the flags that were given; exit 2 naming the bad fields."""
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        return Settings(**given)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            field = ".".join(str(p) for p in err["loc"]) or "settings"
            lines.append(
                f"  {flag_name(field) if field in Settings.model_fields else field}: {err['msg']}"
            )
        typer.echo("invalid settings:\n" + "\n".join(lines), err=True)
        raise typer.Exit(2) from None


def with_settings(func: Callable[..., Any]) -> Callable[..., Any]:
    """Add one option per Settings field to a typer command; pass ``settings=`` instead."""
    sig = inspect.signature(func, eval_str=True)  # real annotations, even under PEP 563
    own = [p for name, p in sig.parameters.items() if name != "settings"]
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
                    help=escape(field.description or ""),  # '[/db]' is no markup
                    rich_help_panel="Settings (env EMBCACHE_<NAME>)",
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
        return func(*args, settings=build_settings(overrides), **kwargs)

    wrapper.__signature__ = sig.replace(parameters=own + extra)  # type: ignore[attr-defined]
    return wrapper
