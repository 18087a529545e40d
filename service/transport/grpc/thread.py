"""Run gRPC servers on a background event loop, for programs without a loop of their own.

Tests, notebooks and synchronous programs use this; the daemon does not (it awaits
``start_grpc`` on its own loop). All servers share one process-wide loop thread: grpc.aio
binds its completion-queue poller to a loop, and creating and closing a loop per server
leaves callbacks aimed at closed loops.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from embcache.service.config import Settings
from embcache.service.engine import CacheEngine
from embcache.service.transport.grpc.errors import RpcMetrics
from embcache.service.transport.grpc.server import GrpcService, start_grpc

_shared: asyncio.AbstractEventLoop | None = None
_shared_lock = threading.Lock()


def background_loop() -> asyncio.AbstractEventLoop:
    """The process-wide loop thread (started on first use, a daemon thread)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="embcache-grpc", daemon=True).start()
            _shared = loop
        return _shared


class GrpcServerThread:
    def __init__(
        self, engine: CacheEngine, settings: Settings, metrics: RpcMetrics | None = None
    ) -> None:
        self._engine = engine
        self._settings = settings
        self._metrics = metrics
        self.loop = background_loop()
        self.service: GrpcService | None = None

    def start(self, timeout: float = 30.0) -> GrpcService:
        self.service = self.call(start_grpc(self._engine, self._settings, self._metrics), timeout)
        return self.service

    def call(self, coro: Any, timeout: float = 30.0) -> Any:
        """Run a coroutine on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, grace: float = 0.5) -> None:
        if self.service is not None:
            service, self.service = self.service, None
            self.call(service.stop(grace), grace + 30.0)

    def __enter__(self) -> GrpcService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def serving(
    settings: Settings, metrics: RpcMetrics | None = None
) -> Iterator[tuple[CacheEngine, GrpcServerThread]]:
    """An engine and a gRPC server for it on the background loop; both closed on exit."""
    engine = CacheEngine(settings)
    try:
        thread = GrpcServerThread(engine, settings, metrics)
        thread.start()
        try:
            yield engine, thread
        finally:
            thread.stop()
    finally:
        engine.close()
