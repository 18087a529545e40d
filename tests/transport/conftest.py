"""Fixtures shared by the client-library tests: a server whose metrics record each call."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from embcache.service.config import Settings
from embcache.service.engine import CacheEngine
from embcache.service.transport.grpc_thread import GrpcServerThread, serving

KiB, MiB = 1 << 10, 1 << 20


class CountingMetrics:
    """Records ``(method, code)`` of every finished call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def observe_rpc(self, transport: str, method: str, code: str, seconds: float) -> None:
        self.calls.append((method, code))


@pytest.fixture
def counting_server(shm_name: str) -> Iterator[tuple[CacheEngine, GrpcServerThread]]:
    """An in-process server on a temporary Unix socket, 1 MiB host pool of 64 KiB pages."""
    with tempfile.TemporaryDirectory(prefix="ecc-") as d:
        settings = Settings(
            grpc_port=0,
            grpc_socket=Path(d) / "c.sock",
            shm_name=shm_name,
            host_pool_bytes=1 * MiB,
            page_bytes=64 * KiB,
        )
        with serving(settings, CountingMetrics()) as pair:
            yield pair
