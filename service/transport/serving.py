"""The data plane: the gRPC server and, beside its Unix socket and its TCP port, the session
socket.

:func:`start_data_plane` starts both on the running loop: the session socket first, so a
client that finds the gRPC socket finds the session socket too, and both serve the same
sessions (the servicer opens them). :class:`GrpcServerThread` runs a data plane on a
background loop, for tests, notebooks and programs without a loop of their own (the daemon
awaits :func:`start_data_plane` on its own). All such servers share one process-wide loop
thread: grpc.aio binds its completion-queue poller to a loop, and a loop made and closed per
server leaves callbacks aimed at closed loops.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from embcache.service.config import Settings
from embcache.service.engine import CacheEngine
from embcache.service.transport.accounting import RpcMetrics
from embcache.service.transport.grpc.server import GrpcService, start_grpc
from embcache.service.transport.grpc.servicer import EmbeddingCacheServicer
from embcache.service.transport.session_socket.admission import Admission
from embcache.service.transport.session_socket.server import (
    SessionSocketServer,
    session_socket_path,
)
from embcache.service.transport.sockets import prepare_socket_path, unlink_socket

log = logging.getLogger("embcache.transport")


@dataclass
class DataPlane:
    """A running gRPC server and its session socket (None with neither a gRPC Unix socket and
    ``session_socket`` nor ``session_socket_tcp``)."""

    grpc: GrpcService
    session_socket: SessionSocketServer | None = None

    @property
    def servicer(self) -> EmbeddingCacheServicer:
        return self.grpc.servicer

    @property
    def ports(self) -> list[int]:
        return self.grpc.ports

    @property
    def socket_path(self) -> Path | None:
        return self.grpc.socket_path

    @property
    def server(self) -> Any:
        return self.grpc.server

    def set_serving(self, serving: bool) -> asyncio.Future[None] | concurrent.futures.Future[None]:
        """SERVING / NOT_SERVING on grpc.health.v1 (:meth:`GrpcService.set_serving`)."""
        return self.grpc.set_serving(serving)

    async def stop(self, grace: float) -> None:
        """Stop accepting and give in-flight calls ``grace`` seconds on both; then the
        session socket's sessions end and the sockets go."""
        await self.grpc.stop_calls(grace)
        if self.session_socket is not None:  # its calls had the same grace; their sessions end here
            await self.session_socket.stop()
            if self.session_socket.path is not None:
                unlink_socket(self.session_socket.path)
        await self.grpc.close()


async def start_data_plane(
    engine: CacheEngine, settings: Settings, metrics: RpcMetrics | None = None
) -> DataPlane:
    """Start the session socket (first: a client that finds the gRPC socket finds it too)
    and the gRPC server for ``engine`` on the running loop; they share one servicer."""
    servicer = EmbeddingCacheServicer(engine, settings, metrics)
    unix = settings.grpc_socket is not None and settings.session_socket
    tcp = settings.session_socket_tcp and settings.tls_cert is None  # it does not speak TLS
    sock = None
    if unix or tcp:
        path = (
            session_socket_path(Path(settings.grpc_socket))
            if settings.grpc_socket and unix
            else None
        )
        limits = Admission.of(settings, metrics)
        sock = SessionSocketServer(servicer.session_service, path, settings.auth_token, limits)
    try:
        if sock is not None and sock.path is not None:
            prepare_socket_path(sock.path)
            await sock.start()
        if sock is not None and tcp:
            servicer.session_socket_tcp_port = await sock.start_tcp(
                settings.grpc_host, settings.session_socket_tcp_port
            )
            log.debug(
                "session socket on TCP at %s:%d",
                settings.grpc_host,
                servicer.session_socket_tcp_port,
            )
        grpc_service = await start_grpc(engine, settings, metrics, servicer)
    except BaseException:
        if sock is not None:
            await sock.stop()
            if sock.path is not None:
                unlink_socket(sock.path)
        servicer.close()
        raise
    return DataPlane(grpc_service, sock)


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
    """A data plane for ``engine`` on :func:`background_loop`: :meth:`start` (or ``with``)
    starts it, :meth:`stop` stops it; the engine stays the caller's."""

    def __init__(
        self, engine: CacheEngine, settings: Settings, metrics: RpcMetrics | None = None
    ) -> None:
        self._engine = engine
        self._settings = settings
        self._metrics = metrics
        self.loop = background_loop()
        self.service: DataPlane | None = None

    def start(self, timeout: float = 30.0) -> DataPlane:
        """Start the data plane and wait (up to ``timeout`` seconds) until it listens."""
        coro = start_data_plane(self._engine, self._settings, self._metrics)
        self.service = self.call(coro, timeout)
        return self.service

    def call(self, coro: Any, timeout: float = 30.0) -> Any:
        """Run a coroutine on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, grace: float = 0.5) -> None:
        """Stop it, giving in-flight calls ``grace`` seconds (a no-op when not started)."""
        if self.service is not None:
            service, self.service = self.service, None
            self.call(service.stop(grace), grace + 30.0)

    def __enter__(self) -> DataPlane:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def serving(
    settings: Settings, metrics: RpcMetrics | None = None
) -> Iterator[tuple[CacheEngine, GrpcServerThread]]:
    """An engine and a data plane for it on the background loop; both closed on exit."""
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
