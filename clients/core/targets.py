"""Where a client connects: its gRPC target, and the daemon's session socket beside it."""

from __future__ import annotations

from embcache.proto.constants import UDS_SUFFIX


def normalize_target(target: str) -> str:
    """``unix:/path`` and ``host:port`` pass through; a bare absolute path is a Unix socket."""
    if target.startswith("/"):
        return f"unix:{target}"
    return target


def uds_path(target: str) -> str | None:
    """The session socket of a daemon reached at ``target``: its Unix socket path plus
    ``.lane``; None for a TCP or abstract-socket target."""
    if not target.startswith("unix:") or target.startswith("unix-abstract:"):
        return None
    path = target[len("unix:") :]
    if path.startswith("//"):  # unix:///abs/path
        path = path[2:]
    return path + UDS_SUFFIX if path else None
