"""Old setting names and the new ones they stand for.

A renamed setting keeps working under its old name (as an argument or an ``EMBCACHE_<OLD>``
environment variable) for one release (CHANGELOG), so a deployment can upgrade before it
changes its configuration; each use logs a line naming the new one.
"""

from __future__ import annotations

import logging
import os
from typing import Any

# Old setting names -> new ones; the old still work for one release (CHANGELOG).
DEPRECATED_NAMES = {
    "session_lane": "session_socket",
    "uds_sessions": "session_socket",
    "tcp_lane": "session_socket_tcp",
    "tcp_lane_port": "session_socket_tcp_port",
    "device_put_landing_bytes": "device_put_prealloc_bytes",
}
log = logging.getLogger("embcache.config")


def apply_renames(data: dict[str, Any]) -> dict[str, Any]:
    """Move values given under old names (arguments, else their env vars) to the new names,
    in place; a value given under the new name wins."""
    for old, new in DEPRECATED_NAMES.items():
        env = os.environ.get(f"EMBCACHE_{old.upper()}")
        value = data.pop(old, None)
        if value is None and env is not None and new not in data:
            value = env
        if value is not None:
            log.warning("setting %r is deprecated: use %r", old, new)
            data.setdefault(new, value)
    return data
