"""The gRPC data plane of the daemon: listeners, options, health, reflection, auth.

``start_grpc(engine, settings, metrics)`` starts it (``serving.start_data_plane`` calls it, with
the session socket beside it, for the daemon). It listens on
``settings.grpc_host:settings.grpc_port`` (port 0 picks a free one) and, when
``settings.grpc_socket`` is set, on that Unix socket. With an auth token every call on every
listener needs ``authorization: Bearer <token>`` (health checks excepted); with TLS the TCP
listener uses it (the Unix socket is local and relies on file permissions).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from embcache.proto.constants import MAX_MESSAGE_BYTES
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.service.config import Settings
from embcache.service.engine import CacheEngine
from embcache.service.transport.accounting import RpcMetrics
from embcache.service.transport.grpc.auth import TokenAuthInterceptor
from embcache.service.transport.grpc.decoding import add_servicer
from embcache.service.transport.grpc.reflection import enable_reflection
from embcache.service.transport.grpc.servicer import EmbeddingCacheServicer
from embcache.service.transport.sockets import prepare_socket_path, unlink_socket

log = logging.getLogger("embcache.grpc")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["EmbeddingCache"].full_name

SERVER_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Ping idle connections so a client that vanished without closing its socket (host
    # down, network cut) is noticed within keepalive_time + keepalive_timeout (15 s) and its
    # Session stream ends, which releases its leases.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # Let clients ping as often as every 5 s without being told to go away.
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
    # Never share a port with another process (Linux SO_REUSEPORT would let two daemons
    # bind 7470 and split the traffic).
    ("grpc.so_reuseport", 0),
)


@dataclass
class GrpcService:
    """A running gRPC server. ``ports``: bound TCP ports; ``socket_path``: Unix socket."""

    server: grpc.aio.Server
    servicer: EmbeddingCacheServicer
    health: Any  # grpc_health.v1.health.aio.HealthServicer
    loop: asyncio.AbstractEventLoop
    ports: list[int] = field(default_factory=list)
    socket_path: Path | None = None

    def set_serving(self, serving: bool) -> asyncio.Future[None] | concurrent.futures.Future[None]:
        """Report SERVING / NOT_SERVING on grpc.health.v1 (overall and for the service).

        Safe to call from the loop (returns a task, awaiting it is optional) or from another
        thread (returns a concurrent future).
        """
        apply = functools.partial(self.apply_serving, serving)
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            return self.loop.create_task(apply())
        return asyncio.run_coroutine_threadsafe(apply(), self.loop)

    async def apply_serving(self, serving: bool) -> None:
        """The awaitable form of :meth:`set_serving`, on the server's loop."""
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def stop(self, grace: float) -> None:
        """:meth:`stop_calls`, then :meth:`close`."""
        await self.stop_calls(grace)
        await self.close()

    async def stop_calls(self, grace: float) -> None:
        """NOT_SERVING, stop accepting, give in-flight calls ``grace`` seconds, then cancel.
        Cancelled Session streams release their leases; cancelled Puts free their pages."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)

    async def close(self) -> None:
        """Once the calls stopped: the busy poller, the IPC mappings, the socket file."""
        await self.servicer.busy.stop()
        self.servicer.close()
        if self.socket_path is not None:
            unlink_socket(self.socket_path)


async def start_grpc(
    engine: CacheEngine,
    settings: Settings,
    metrics: RpcMetrics | None = None,
    servicer: EmbeddingCacheServicer | None = None,
) -> GrpcService:
    """Start the gRPC server for ``engine`` (with ``servicer``, when the caller made it:
    the session socket shares it) on the running loop."""
    interceptors = []
    if settings.auth_token:
        interceptors.append(TokenAuthInterceptor(settings.auth_token, metrics))
    server = grpc.aio.server(interceptors=interceptors, options=SERVER_OPTIONS)
    if servicer is None:
        servicer = EmbeddingCacheServicer(engine, settings, metrics)
    add_servicer(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    enable_reflection(server, (SERVICE_NAME, health.SERVICE_NAME))

    ports = [_add_tcp_port(server, settings)]
    socket_path = None
    if settings.grpc_socket is not None:
        socket_path = Path(settings.grpc_socket)
        prepare_socket_path(socket_path)
        server.add_insecure_port(f"unix:{socket_path}")
    await server.start()
    servicer.busy.start()
    service = GrpcService(
        server, servicer, health_servicer, asyncio.get_running_loop(), ports, socket_path
    )
    await service.apply_serving(True)
    log.debug(  # the daemon says where every listener is, once all are up
        "gRPC listening on %s:%s%s",
        settings.grpc_host,
        ports[0],
        f" and unix:{socket_path}" if socket_path else "",
    )
    return service


def _add_tcp_port(server: grpc.aio.Server, settings: Settings) -> int:
    host = settings.grpc_host
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    address = f"{host}:{settings.grpc_port}"
    if settings.tls_cert is not None and settings.tls_key is not None:
        ca = settings.tls_client_ca
        creds = grpc.ssl_server_credentials(
            [(Path(settings.tls_key).read_bytes(), Path(settings.tls_cert).read_bytes())],
            root_certificates=Path(ca).read_bytes() if ca is not None else None,
            require_client_auth=ca is not None,  # mTLS: a verified client certificate
        )
        add = functools.partial(server.add_secure_port, address, creds)
    else:
        add = functools.partial(server.add_insecure_port, address)
    try:
        port = add()
    except RuntimeError:  # grpcio >= 1.62 raises where older ones returned 0
        port = 0
    if not port:
        raise OSError(
            errno.EADDRINUSE,
            f"cannot bind gRPC to {address}: the port is in use or the address is not this "
            "machine's (--grpc-port, 0 picks a free one; --grpc-host)",
        )
    return port
