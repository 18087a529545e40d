from __future__ import annotations

import os
import socket
import stat
import time
from pathlib import Path

import pytest

from embcache.clients.device.pools import fetch_fd
from embcache.service.device.ipc.fd_server import FdServer


def _memfd(content: bytes) -> int:
    fd = os.memfd_create("embcache-test")
    os.write(fd, content)
    return fd


def test_fd_passing_and_tokens(tmp_path: Path) -> None:
    exported: list[int] = []

    def lookup(pool_id: str):  # type: ignore[no-untyped-def]
        if pool_id != "dev0-abc":
            return None

        def export() -> int:
            fd = _memfd(b"pool bytes")
            exported.append(fd)
            return fd

        return 12345, export

    path = tmp_path / "d.sock.fds"
    path.write_text("stale")  # a socket left by an earlier daemon is replaced
    server = FdServer(path, lookup)
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o660
        fd = fetch_fd(path, "dev0-abc", 12345)
        try:
            assert os.pread(fd, 100, 0) == b"pool bytes"
        finally:
            os.close(fd)
        with pytest.raises(ConnectionError, match="bad token"):
            fetch_fd(path, "dev0-abc", 1)
        with pytest.raises(ConnectionError, match="unknown pool"):
            fetch_fd(path, "dev9", 12345)
        with socket.socket(socket.AF_UNIX) as s:  # garbage is answered, not fatal
            s.connect(str(path))
            s.sendall(b"\xff\x00 not json\n")
            assert s.recv(100).startswith(b"ERR malformed")
        before = len(os.listdir("/proc/self/fd"))
        os.close(fetch_fd(path, "dev0-abc", 12345))  # the server still answers
        assert len(exported) == 2
        deadline = time.monotonic() + 2  # the handler thread closes its socket after replying
        while len(os.listdir("/proc/self/fd")) > before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(os.listdir("/proc/self/fd")) <= before  # the server closed its fd copy
    finally:
        server.close()
    assert not path.exists()
