"""Run the gRPC server on a private event loop in a background thread.

For programs without an asyncio loop of their own (tests, notebooks, embedding the data
plane next to synchronous code). The daemon does not use this: it awaits ``start_grpc``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from ..config import Settings
from ..engine import CacheEngine
from .grpc_errors import RpcMetrics
from .grpc_server import GrpcService, start_grpc


class GrpcServerThread:
    def __init__(
        self, engine: CacheEngine, settings: Settings, metrics: RpcMetrics | None = None
    ) -> None:
        self._engine = engine
        self._settings = settings
        self._metrics = metrics
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.service: GrpcService | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def start(self, timeout: float = 30.0) -> GrpcService:
        self._thread.start()
        self.service = self.call(start_grpc(self._engine, self._settings, self._metrics), timeout)
        return self.service

    def call(self, coro: Any, timeout: float = 30.0) -> Any:
        """Run a coroutine on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def stop(self, grace: float = 0.5) -> None:
        if self.service is not None:
            self.call(self.service.stop(grace), grace + 30.0)
            self.service = None
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10.0)
        if not self._loop.is_closed() and not self._loop.is_running():
            self._loop.close()

    def __enter__(self) -> GrpcService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def serving(
    settings: Settings, metrics: RpcMetrics | None = None
) -> Iterator[tuple[CacheEngine, GrpcServerThread]]:
    """An engine and a gRPC server for it on a background loop; both closed on exit."""
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
