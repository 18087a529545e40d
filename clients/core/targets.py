"""Where a client connects: its gRPC target, and the daemon's session socket beside it."""

from __future__ import annotations

from embcache.proto.constants import SESSION_SOCKET_SUFFIX


def normalize_target(target: str) -> str:
    """``unix:/path`` and ``host:port`` pass through; a bare absolute path is a Unix socket."""
    if target.startswith("/"):
        return f"unix:{target}"
    return target


def session_socket_path(target: str) -> str | None:
    """The session socket of a daemon reached at ``target``: its Unix socket path plus
    ``.lane``; None for a TCP or abstract-socket target."""
    if not target.startswith("unix:") or target.startswith("unix-abstract:"):
        return None
    path = target[len("unix:") :]
    if path.startswith("//"):  # unix:///abs/path
        path = path[2:]
    return path + SESSION_SOCKET_SUFFIX if path else None


def tcp_address(target: str, port: int) -> tuple[str, int] | None:
    """``(host, port)`` on the host of a TCP ``target`` (``host:port``, ``[v6]:port``,
    ``dns:///host:port``); None for a Unix or other target."""
    if target.startswith(("unix:", "unix-abstract:", "vsock:")):
        return None
    if target.startswith("dns:"):
        target = target[len("dns:") :].lstrip("/")
        if "/" in target:  # dns://authority/host:port
            target = target.rsplit("/", 1)[1]
    for scheme in ("ipv4:", "ipv6:"):
        if target.startswith(scheme):
            target = target[len(scheme) :].split(",")[0]
    host, sep, _ = target.rpartition(":")
    if not sep or not host:
        return None
    return host.strip("[]"), port
