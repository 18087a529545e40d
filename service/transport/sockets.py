"""Unix sockets of the daemon's listeners: replacing a stale socket file, removing one, and
who is at the other end of a connection."""

from __future__ import annotations

import errno
import logging
import socket
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("embcache.transport")


def prepare_socket_path(path: Path) -> None:
    """Remove a stale socket left by a dead daemon; refuse a live one or a non-socket."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        return
    if not stat.S_ISSOCK(mode):
        raise FileExistsError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        log.warning("removing stale socket %s", path)
        path.unlink(missing_ok=True)
        return
    finally:
        probe.close()
    raise OSError(errno.EADDRINUSE, f"another process is listening on {path}")


def unlink_socket(path: Path) -> None:
    """Remove the socket file at ``path``, if it is one (anything else stays)."""
    try:
        if stat.S_ISSOCK(path.lstat().st_mode):
            path.unlink()
    except FileNotFoundError:
        pass


@dataclass(frozen=True, slots=True)
class PeerCredentials:
    """The process at the other end of a Unix socket connection, as the kernel saw it when
    it connected (``SO_PEERCRED``; pids are of this daemon's pid namespace)."""

    pid: int
    uid: int
    gid: int


_UCRED = struct.Struct("3i")


def peer_credentials(sock: Any) -> PeerCredentials | None:
    """The peer of a connected Unix socket (``socket.socket``, or asyncio's transport
    socket); None where the platform or the socket cannot say (not AF_UNIX, no pid: a
    peer in a pid namespace this daemon cannot see)."""
    option = getattr(socket, "SO_PEERCRED", None)
    if sock is None or option is None or getattr(sock, "family", None) != socket.AF_UNIX:
        return None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, option, _UCRED.size)
    except OSError:
        return None
    pid, uid, gid = _UCRED.unpack(raw)
    return PeerCredentials(pid, uid, gid) if pid > 0 else None
