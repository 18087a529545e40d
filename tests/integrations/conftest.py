"""A real embcache daemon on a temporary Unix socket, shared by one test module."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from embcache.clients import EmbCacheClient
from embcache.service.daemon_process import DaemonProcess


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    """One daemon per module (64 MiB host pool, gRPC on a Unix socket and loopback)."""
    with tempfile.TemporaryDirectory(prefix="embcache-int-") as folder:
        proc = DaemonProcess(
            ["--grpc-socket", str(Path(folder) / "d.sock"), "--host-pool-bytes", "64MiB"]
        )
        try:
            yield proc
        finally:
            proc.stop()


@pytest.fixture
def client(daemon: DaemonProcess) -> Iterator[EmbCacheClient]:
    with EmbCacheClient(daemon.unix_target) as c:
        yield c
