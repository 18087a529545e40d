"""Unix socket files of the daemon's listeners: replacing a stale one, removing one; and
who is at the other end of a connection (``SO_PEERCRED``); TCP keepalive on one."""

from __future__ import annotations

import errno
import fcntl
import logging
import socket
import stat
import struct
import termios
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


_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_credentials(sock: socket.socket | None) -> tuple[int, int, int] | None:
    """``(pid, uid, gid)`` of the process at the other end of a Unix socket, from the
    kernel (``SO_PEERCRED``, as of when it connected); None where there is none (not Linux,
    not a Unix socket)."""
    if sock is None or not hasattr(socket, "SO_PEERCRED") or sock.family != socket.AF_UNIX:
        return None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    except OSError:
        return None
    pid, uid, gid = _UCRED.unpack(raw)
    return pid, uid, gid


# A TCP peer that stops answering is dropped after about KEEPIDLE + KEEPCNT * KEEPINTVL s.
KEEPIDLE_S, KEEPINTVL_S, KEEPCNT = 30, 10, 3


def keepalive(sock: socket.socket) -> None:
    """TCP keepalive on an accepted connection, where the platform has the options."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", KEEPIDLE_S), ("TCP_KEEPINTVL", KEEPINTVL_S),
                            ("TCP_KEEPCNT", KEEPCNT)):  # fmt: skip
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    except OSError as err:
        log.debug("session socket: no TCP keepalive: %s", err)


def unread_bytes(sock: socket.socket | None) -> int:
    """Bytes queued in the kernel for ``sock`` that nobody has read yet (0 where the kernel
    cannot say: a closed socket)."""
    if sock is None:
        return 0
    try:
        raw = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
    except (OSError, ValueError):
        return 0
    return int(struct.unpack("i", raw)[0])
