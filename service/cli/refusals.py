"""One format for every refusal to start: ``cannot start: <setting>: <reason>``.

``<setting>`` says where the value at fault came from, so the operator knows what to
change: ``--grpc-port 7470`` for a flag, ``EMBCACHE_GRPC_PORT=7470 (--grpc-port)`` for an
environment variable, ``--grpc-port 7470 (the default)`` otherwise. The reason speaks of
flags, never of pydantic or of the model's field names. The line goes to stderr through
the ``embcache`` logger, in the log format asked for (text or json), like every other line
the daemon writes.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from embcache.service import logs
from embcache.service.cli.settings_help import env_var
from embcache.service.config import Settings

log = logging.getLogger("embcache")

SECRET_FIELDS = frozenset({"auth_token"})  # never echoed back
# What pydantic puts before the text a validator raised.
_PYDANTIC_PREFIXES = ("Value error, ", "Assertion failed, ")


def flag_name(field: str) -> str:
    """The flag of a Settings field: ``host_pool_bytes`` -> ``--host-pool-bytes``."""
    return "--" + field.replace("_", "-")


class SettingSources:
    """Where each setting's value came from: the flags given, else the environment."""

    def __init__(self, given: Mapping[str, Any], environ: Mapping[str, str] | None = None):
        self.given = {k: v for k, v in given.items() if v is not None}
        self.environ = dict(os.environ if environ is None else environ)

    def origin(self, field: str) -> str:
        """``flag``, ``env`` or ``default``."""
        if field in self.given:
            return "flag"
        return "env" if env_var(field) in self.environ else "default"

    def describe(self, field: str, value: Any = None) -> str:
        """The setting as the operator gave it (module docstring)."""
        flag = flag_name(field)
        origin = self.origin(field)
        if value is None:
            value = self.given.get(field) if origin == "flag" else self.environ.get(env_var(field))
        shown = "" if value is None else _shown(field, value)
        if origin == "flag":
            return f"{flag} {shown}".rstrip()
        if origin == "env":
            return f"{env_var(field)}={shown} ({flag})"
        return f"{flag} {shown} (the default)" if shown else flag


def _shown(field: str, value: Any) -> str:
    if field in SECRET_FIELDS:
        return "<hidden>"
    text = str(value)
    return repr(text) if not text or any(c.isspace() for c in text) else text


# Pydantic's words for a value of the wrong type, said as the operator would give it.
_TYPE_REASONS = {
    "bool_parsing": "must be on or off (or true/false, yes/no, 1/0)",
    "bool_type": "must be on or off (or true/false, yes/no, 1/0)",
    "int_parsing": "must be a whole number",
    "int_from_float": "must be a whole number",
    "float_parsing": "must be a number",
}


def reason_of(err: Any) -> str:
    """A validation error's reason in the operator's words (``speak_flags``)."""
    if err.get("type") in _TYPE_REASONS:
        return _TYPE_REASONS[err["type"]]
    return speak_flags(str(err["msg"]).replace("Input should be", "must be"))


def speak_flags(text: str) -> str:
    """A validator's message with field names as flags: ``grpc_host=0.0.0.0`` ->
    ``--grpc-host 0.0.0.0``, ``auth_token`` -> ``--auth-token``; pydantic's prefix gone."""
    for prefix in _PYDANTIC_PREFIXES:
        text = text.removeprefix(prefix)
    names = "|".join(sorted(Settings.model_fields, key=len, reverse=True))
    text = re.sub(rf"(?<![\w-])({names})=", lambda m: flag_name(m.group(1)) + " ", text)
    return re.sub(rf"(?<![\w-])({names})(?![\w-])", lambda m: flag_name(m.group(1)), text)


def settings_refusals(exc: ValidationError, sources: SettingSources) -> list[str]:
    """One ``<setting>: <reason>`` per error of a Settings validation."""
    out = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        reason = reason_of(err)
        field = loc[0] if loc and loc[0] in Settings.model_fields else None
        if field is not None:
            out.append(f"{sources.describe(field, err.get('input'))}: {reason}")
            continue
        if loc:  # a name that is no setting (extra="forbid")
            out.append(f"{flag_name(loc[0])}: not a setting of this version")
            continue
        # A check across settings: name those of them the operator set.
        mentioned = [f for f in Settings.model_fields if re.search(rf"(?<![\w-]){f}(?![\w-])",
                                                                   str(err["msg"]))]  # fmt: skip
        set_here = [sources.describe(f) for f in mentioned if sources.origin(f) != "default"]
        out.append(f"{', '.join(set_here)}: {reason}" if set_here else reason)
    return out


def refuse(reasons: list[str], fmt: str | None = None) -> None:
    """Log each reason as ``cannot start: ...`` on the ``embcache`` logger; with ``fmt``
    (before logging is configured: settings that failed validation), straight to stderr in
    that format, whatever handlers the process has."""
    if fmt is None:
        for reason in reasons:
            log.error("cannot start: %s", reason)
        return
    handler = logs.stderr_handler(fmt)
    for reason in reasons:
        record = log.makeRecord(log.name, logging.ERROR, __file__, 0, "cannot start: %s",
                                (reason,), None)  # fmt: skip
        handler.handle(record)
    handler.flush()
