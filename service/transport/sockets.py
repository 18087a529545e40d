"""Unix socket files of the daemon's listeners: replacing a stale one, removing one."""

from __future__ import annotations

import errno
import logging
import socket
import stat
from pathlib import Path

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
