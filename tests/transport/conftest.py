"""Fixtures shared by the client-library tests: a server whose metrics record each call."""

from __future__ import annotations

import contextlib
import functools
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from embcache.service.config import Settings
from embcache.service.engine import CacheEngine
from embcache.service.transport.serving import GrpcServerThread, serving

KiB, MiB = 1 << 10, 1 << 20


class CountingMetrics:
    """Records ``(method, code)`` of every finished call, and ``(transport, method, code)``;
    the session socket's refusals and the dropped touches."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.by_transport: list[tuple[str, str, str]] = []
        self.refusals: list[tuple[str, str]] = []  # (listener, reason) of the session socket
        self.dropped_touches = 0

    def observe_rpc(self, transport: str, method: str, code: str, seconds: float) -> None:
        self.calls.append((method, code))
        self.by_transport.append((transport, method, code))

    def observe_refusal(self, listener: str, reason: str) -> None:
        self.refusals.append((listener, reason))

    def observe_dropped_touch(self) -> None:
        self.dropped_touches += 1


@contextlib.contextmanager
def temp_server(shm_name: str, **extra: Any) -> Iterator[tuple[CacheEngine, GrpcServerThread]]:
    """An in-process server on a temporary Unix socket, 1 MiB host pool of 64 KiB pages;
    ``extra`` settings on top (the sizes included)."""
    with tempfile.TemporaryDirectory(prefix="ecc-") as d:
        sizes = {"host_pool_bytes": 1 * MiB, "page_bytes": 64 * KiB}
        settings = Settings(
            grpc_port=0,
            grpc_socket=Path(d) / "c.sock",
            shm_name=shm_name,
            **{**sizes, **extra},
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


def _wait_until(predicate: Callable[[], object], timeout: float = 5.0) -> bool:
    """Poll ``predicate`` until it holds or ``timeout`` passes; whether it holds."""
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(predicate())


def _concurrently(work: Callable[[int], None], threads: int, timeout: float = 60.0) -> None:
    """``work(0)`` ... ``work(threads - 1)`` on as many threads at once; re-raises the first
    failure once all have ended."""
    errors: list[BaseException] = []

    def run(seed: int) -> None:
        try:
            work(seed)
        except BaseException as exc:
            errors.append(exc)

    started = [threading.Thread(target=run, args=(seed,)) for seed in range(threads)]
    for th in started:
        th.start()
    for th in started:
        th.join(timeout)
    assert not any(th.is_alive() for th in started), "a thread did not finish in time"
    if errors:
        raise errors[0]


@pytest.fixture(name="wait_until")
def wait_until_fixture() -> Callable[..., bool]:
    """:func:`_wait_until`: ``assert wait_until(lambda: ...)``."""
    return _wait_until


@pytest.fixture(name="concurrently")
def concurrently_fixture() -> Callable[..., None]:
    """:func:`_concurrently`: ``concurrently(work, threads)``."""
    return _concurrently
