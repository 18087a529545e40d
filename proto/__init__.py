"""The wire contract (``proto/embcache/v1/*.proto``) and its generated Python stubs.

The stubs are generated at build/install time by ``setup.py``. A source checkout that runs
without an install (or after the .proto changed) gets them generated on first import by
:func:`ensure_stubs`, which ``embcache.proto.embcache.v1`` calls; so importing
``embcache.proto.embcache.v1.embcache_pb2`` always works where grpcio-tools is installed.
"""

from __future__ import annotations

import logging

_log = logging.getLogger(__name__)


def ensure_stubs() -> None:
    """Generate the stubs if they are missing or older than the .proto (cheap when current)."""
    from embcache.proto import codegen

    if not codegen.is_stale():
        return
    try:
        written = codegen.generate()
    except OSError as exc:
        if all(path.exists() for path in codegen.generated_paths()):
            _log.warning("embcache stubs look stale but cannot be regenerated (%s)", exc)
            return
        raise
    if written:
        _log.info("generated %d embcache stub files from the .proto", len(written))
