"""One format for every log line of the daemon, its own and uvicorn's.

``configure(level, fmt)`` gives the root logger one handler on stderr, plain text by default
(``2026-01-01 12:00:00,000 INFO embcache.daemon: ...``) or one JSON object a line with
``--log-format json`` (``time``, ``level``, ``logger``, ``message``, and ``exception`` with
the traceback when there is one). uvicorn's loggers lose their own handlers and propagate
here (the daemon gives uvicorn ``log_config=None``); their records are named
``embcache.http`` like the daemon's own HTTP lines, and below ``debug`` only their warnings
and errors show: the daemon says itself where HTTP listens (``Daemon._announce``).
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi")
HTTP_LOGGER = "embcache.http"  # the name uvicorn's records are shown under


class _UvicornAsHttp(logging.Filter):
    """Show uvicorn's records under the daemon's HTTP logger name."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "uvicorn" or record.name.startswith("uvicorn."):
            record.name = HTTP_LOGGER
        return True


class JsonFormatter(logging.Formatter):
    """A log record as one line of JSON."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def stderr_handler(fmt: str = "text") -> logging.Handler:
    """A handler that writes records to stderr in ``fmt`` (text or json)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    handler.addFilter(_UvicornAsHttp())
    return handler


def configure(level: str, fmt: str = "text") -> None:
    """Route every logger, uvicorn's included, through one stderr handler in ``fmt``."""
    handler = stderr_handler(fmt)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # uvicorn's start-up chatter ("Started server process", "Waiting for application
    # startup.") says nothing an operator acts on; its warnings and errors do.
    uvicorn_level = logging.DEBUG if level.lower() == "debug" else logging.WARNING
    for name in UVICORN_LOGGERS:
        logger = logging.getLogger(name)
        for old in list(logger.handlers):
            logger.removeHandler(old)
        logger.propagate = True
        logger.setLevel(uvicorn_level)
