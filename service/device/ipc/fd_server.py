"""Hands device-pool file descriptors to local clients over a Unix socket (SCM_RIGHTS).

POSIX-fd IPC lets containers that share no IPC or PID namespace open the daemon's device
pool: they only need this socket's directory. A client sends one JSON line
``{"pool_id": ..., "token": ...}``; the token is a per-pool secret that the daemon gives
only to authenticated callers in its Get replies. The reply is ``OK`` with the fd attached,
or ``ERR <reason>``. The socket's mode is 0660 by default (owner and group only).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import socketserver
import threading
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

# (pool_id) -> (token, export_fd) or None
PoolLookup = Callable[[str], "tuple[int, Callable[[], int]] | None"]
MAX_REQUEST = 4096


class _Handler(socketserver.StreamRequestHandler):
    server: _Server

    def handle(self) -> None:
        self.request.settimeout(5.0)
        try:
            line = self.rfile.readline(MAX_REQUEST)
            req = json.loads(line)
            pool_id, token = str(req["pool_id"]), int(req["token"])
        except (OSError, ValueError, KeyError, TypeError):
            self._reply(b"ERR malformed request\n")
            return
        found = self.server.lookup(pool_id)
        if found is None or found[0] != token:
            self._reply(b"ERR unknown pool or bad token\n")
            return
        fd = found[1]()
        try:
            socket.send_fds(self.request, [b"OK\n"], [fd])
        except OSError as exc:
            log.warning("could not send a pool fd: %s", exc)
        finally:
            os.close(fd)

    def _reply(self, message: bytes) -> None:
        with contextlib.suppress(OSError):
            self.request.sendall(message)


class _Server(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True
    lookup: PoolLookup


class FdServer:
    """The fd socket at ``path`` (mode ``mode``), served from a daemon thread.
    ``lookup(pool_id)`` gives a pool's token and its fd export, or None."""

    def __init__(self, path: Path, lookup: PoolLookup, mode: int = 0o660) -> None:
        self.path = Path(path)
        if self.path.exists() or self.path.is_symlink():
            self.path.unlink()  # a stale socket from an earlier daemon
        old = os.umask(0o117)
        try:
            self._server = _Server(str(self.path), _Handler)
        finally:
            os.umask(old)
        os.chmod(self.path, mode)
        self._server.lookup = lookup
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="fd-server", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Stop serving and remove the socket file."""
        self._server.shutdown()
        self._server.server_close()
        self.path.unlink(missing_ok=True)
