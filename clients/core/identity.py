"""Who a client says it is when the caller does not say: its token from the environment the
``embcache`` CLI reads too, and a name that tells its session apart in ``embcache sessions``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

TOKEN_ENV = "EMBCACHE_AUTH_TOKEN"


def default_token(token: str | None) -> str | None:
    """``token`` when given (an empty string: explicitly none), else ``EMBCACHE_AUTH_TOKEN``."""
    if token is not None:
        return token or None
    return os.environ.get(TOKEN_ENV) or None


def program_name() -> str:
    """The running program as a person would name it: the script (``encode.py``), the
    package of ``python -m pkg``, else the interpreter (``python3``)."""
    argv0 = sys.argv[0] if sys.argv else ""
    path = Path(argv0)
    if path.name == "__main__.py":
        return path.parent.name or "python"
    if argv0 and argv0 not in ("-c", "-m", "-"):
        return path.name
    return Path(sys.executable or "python").name or "python"


def default_client_name(client_name: str | None) -> str:
    """``client_name`` when given, else ``<program>:<pid>`` (``python3:12345``)."""
    return client_name or f"{program_name()}:{os.getpid()}"
