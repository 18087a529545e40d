"""Fixtures shared by the client-library tests: a server whose metrics record each call."""

from __future__ import annotations

import contextlib
import functools
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from embcache.service.config import Settings
from embcache.service.engine import CacheEngine
from embcache.service.transport.grpc_thread import GrpcServerThread, serving

KiB, MiB = 1 << 10, 1 << 20


class CountingMetrics:
    """Records ``(method, code)`` of every finished call, and ``(transport, method, code)``."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.by_transport: list[tuple[str, str, str]] = []

    def observe_rpc(self, transport: str, method: str, code: str, seconds: float) -> None:
        self.calls.append((method, code))
        self.by_transport.append((transport, method, code))


@contextlib.contextmanager
def temp_server(shm_name: str, **extra: Any) -> Iterator[tuple[CacheEngine, GrpcServerThread]]:
    """An in-process server on a temporary Unix socket, 1 MiB host pool of 64 KiB pages;
    ``extra`` settings on top."""
    with tempfile.TemporaryDirectory(prefix="ecc-") as d:
        settings = Settings(
            grpc_port=0,
            grpc_socket=Path(d) / "c.sock",
            shm_name=shm_name,
            host_pool_bytes=1 * MiB,
            page_bytes=64 * KiB,
            **extra,
        )
        with serving(settings, CountingMetrics()) as pair:
            yield pair


@pytest.fixture
def counting_server(shm_name: str) -> Iterator[tuple[CacheEngine, GrpcServerThread]]:
    """:func:`temp_server` with default settings."""
    with temp_server(shm_name) as pair:
        yield pair


@pytest.fixture
def server_factory(shm_name: str) -> Any:
    """:func:`temp_server` for this test's segment name: ``with server_factory(**extra)``."""
    return functools.partial(temp_server, shm_name)
