"""The daemon process: engine + gRPC + HTTP on one asyncio loop, a lease reaper, drain.

Start-up order: host pool (may take a while to pin), then listeners, then one JSON line
``{"event": "ready", ...}`` on stdout. SIGTERM/SIGINT: health NOT_SERVING, the engine
refuses new work, in-flight calls get ``drain_grace_s`` to finish, every lease is
released, the shared-memory segment is removed (with ``--warm-restart on``, the default, it
stays with its index for the next daemon to adopt: docs/restart.md), exit code 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import signal
import socket
import ssl
import sys
from collections.abc import Callable, Iterator
from typing import Any

import uvicorn

from embcache.service import logs
from embcache.service.config import Settings
from embcache.service.device.ipc.fd_server import FdServer
from embcache.service.engine import CacheEngine
from embcache.service.malloc import tune_malloc
from embcache.service.observability import mps
from embcache.service.startup import check_unix_socket, preflight
from embcache.service.text import plural

log = logging.getLogger("embcache.daemon")


class _QuietSignalsServer(uvicorn.Server):
    """uvicorn server that leaves signal handling to the daemon."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # uvicorn >= 0.29
        yield

    def install_signal_handlers(self) -> None:  # older uvicorn
        return None


def _start_fd_server(engine: CacheEngine, settings: Settings) -> FdServer | None:
    """The Unix socket that hands POSIX fds of the device pools to local clients."""
    pools = {p.pool_id: p for p in engine.device.pools if p.ipc_mode == "fd"}
    if not pools:
        return None

    def lookup(pool_id: str) -> tuple[int, Callable[[], int]] | None:
        pool = pools.get(pool_id)
        return None if pool is None else (pool.fd_token, pool.export_fd)

    path = settings.effective_ipc_socket
    check_unix_socket(path, "ipc_socket")
    return FdServer(path, lookup, int(settings.socket_mode, 8))


def _sd_notify(message: str) -> None:
    """Tell systemd (Type=notify) about readiness or stopping; a no-op elsewhere."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return
    if address.startswith("@"):
        address = "\0" + address[1:]  # abstract namespace
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.sendto(message.encode(), address)


class Daemon:
    """One daemon run (module docstring); :meth:`request_stop` starts the drain."""

    def __init__(self, settings: Settings, http_sock: socket.socket) -> None:
        self.settings = settings
        self._http_sock = http_sock  # bound by startup.preflight; listens once we serve
        self._stop = asyncio.Event()

    def request_stop(self) -> None:
        """Begin the drain (what SIGTERM and SIGINT do); call on the daemon's loop."""
        self._stop.set()

    async def run(self) -> int:
        """Start everything, print the ready line, serve until asked to stop, then drain;
        returns the exit code (0; a failed start raises)."""
        from embcache.service.observability.metrics import Metrics
        from embcache.service.shared_tier import SharedTierConfig, shared_tier_hooks
        from embcache.service.transport.http.app import create_app
        from embcache.service.transport.http.listener import uvicorn_config
        from embcache.service.transport.serving import start_data_plane

        s = self.settings
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        metrics = Metrics()
        tier_config = SharedTierConfig.from_settings(s)
        # A shared tier that is down at start is a degraded start, not a failed one.
        shared = shared_tier_hooks(tier_config, metrics) if tier_config is not None else None
        engine = await asyncio.to_thread(
            CacheEngine,
            s,
            copy_observer=metrics.observe_copy,
            shared_tier=shared,
            defer_verify=True,  # started after the ready line (docs/restart.md)
        )
        fd_server = grpc_service = None
        try:
            metrics.watch_engine(engine)
            fd_server = _start_fd_server(engine, s)
            grpc_service = await start_data_plane(engine, s, metrics)
            metrics.watch_ipc(grpc_service.servicer.device.ipc)
            http_sock = self._http_sock
            http_sock.listen(512)
            app = create_app(engine, s, metrics, grpc_service.servicer.admin)
            app.state.settle = grpc_service.servicer.posted.settle  # one loop: both planes
            app.state.endpoints = {  # in /v1/stats: the CLI finds the gRPC plane from it
                "grpc_port": grpc_service.ports[0] if grpc_service.ports else None,
                "grpc_socket": str(grpc_service.socket_path) if grpc_service.socket_path else None,
            }
            config = uvicorn_config(  # with the header timeout and the concurrency bound
                app,
                s,
                # uvicorn sets its loggers' levels from this: its info lines only in debug.
                log_level="debug" if s.log_level == "debug" else "warning",
                log_config=None,  # uvicorn's lines go through our handler (service/logs.py)
                access_log=False,
                ssl_certfile=str(s.tls_cert) if s.tls_cert else None,
                ssl_keyfile=str(s.tls_key) if s.tls_key else None,
                ssl_ca_certs=str(s.tls_client_ca) if s.tls_client_ca else None,
                ssl_cert_reqs=ssl.CERT_REQUIRED if s.tls_client_ca else ssl.CERT_NONE,
                timeout_graceful_shutdown=max(1, int(s.drain_grace_s)),
            )
            http = _QuietSignalsServer(config)
            http_task = asyncio.create_task(http.serve(sockets=[http_sock]))
            reaper = asyncio.create_task(self._reap(engine))
            while not http.started:
                if http_task.done():
                    await http_task  # raises the start-up error
                    raise RuntimeError("HTTP server exited during start-up")
                await asyncio.sleep(0.01)
            if grpc_service.socket_path:
                os.chmod(grpc_service.socket_path, int(s.socket_mode, 8))
            if (
                grpc_service.session_socket is not None
                and grpc_service.session_socket.path is not None
            ):
                os.chmod(grpc_service.session_socket.path, int(s.socket_mode, 8))
            self._announce(grpc_service, http_sock.getsockname()[1], engine)
            _sd_notify("READY=1")
            engine.start_verifier()  # adopted entries: checked from now on, and when read
            await self._stop.wait()
            _sd_notify("STOPPING=1")
            log.info("draining: refusing new work, %.1fs grace", s.drain_grace_s)
            grpc_service.set_serving(False)
            engine.begin_drain()
            service, grpc_service = grpc_service, None
            await service.stop(s.drain_grace_s)
            http.should_exit = True
            await http_task
            reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reaper
        finally:
            if grpc_service is not None:  # start-up failed after the data plane started
                await grpc_service.stop(0)
            if fd_server is not None:
                fd_server.close()
            # The shared tier writes what it has queued; a warm restart keeps the segment.
            await asyncio.to_thread(engine.close, keep_segment=s.warm_restart)
        log.info("stopped cleanly")
        return 0

    async def _reap(self, engine: CacheEngine) -> None:
        """Expire leases, free what exited processes kept quarantined and launch due
        page-table updates, at least once a second."""
        period = min(1.0, self.settings.lease_ttl_s / 4)
        while True:
            await asyncio.sleep(period)
            expired = engine.expire_leases()
            if expired:
                log.info("expired %s", plural(expired, "lease"))
            try:
                if freed := engine.quarantine.reap():
                    log.info("freed %s of exited processes", plural(freed, "quarantined lease"))
                engine.device.flush_due()  # page tables catch up once gets stop
            except Exception:  # never the end of the reaper: leases must still expire
                log.exception("freeing quarantined pages or launching table updates failed")

    def _announce(self, grpc_service: Any, http_port: int, engine: CacheEngine) -> None:
        ports = list(getattr(grpc_service, "ports", []) or [])
        pipe = mps.control_pipe()
        segment, pools = engine.host_segment(), engine.device.pools
        sock = getattr(grpc_service, "session_socket", None)
        sock_path = str(sock.path) if sock is not None and sock.path else None
        sock_port = grpc_service.servicer.session_socket_tcp_port or None
        ready = {
            "event": "ready",
            "grpc_port": ports[0] if ports else None,
            "grpc_socket": str(grpc_service.socket_path) if grpc_service.socket_path else None,
            "session_socket": sock_path,
            "session_socket_tcp_port": sock_port,
            # the same two under their former names, for tools written against them
            "session_lane": sock_path,
            "tcp_lane_port": sock_port,
            "http_port": http_port,
            "shm_name": segment.name,
            "cuda": segment.registered,
            "device_pools": [p.pool_id for p in pools],
            "ipc_socket": str(self.settings.effective_ipc_socket)
            if any(p.ipc_mode == "fd" for p in pools)
            else None,
            "mps_control": str(pipe) if pipe else None,
        }
        sys.stdout.write(json.dumps(ready) + "\n")  # the one ready event (stdout, for tools)
        sys.stdout.flush()
        for line in listening_lines(self.settings, ready):
            log.info("%s", line)
        if pools and pipe is None:
            log.warning(
                "no MPS control daemon (CUDA_MPS_PIPE_DIRECTORY): decoders' kernels on these "
                "GPUs time-slice with this daemon's table updates (launched together, at most "
                "every --device-table-flush-s) and its copy kernel (runs under 128 KiB); run "
                "both under MPS (docs/deploy.md, MPS)"
            )


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def listening_lines(settings: Settings, ready: dict[str, Any]) -> list[str]:
    """One line per listener, for people (the ready line on stdout is for tools)."""
    s = settings
    lines = []
    tls = " (TLS)" if s.tls_cert else ""
    if ready.get("grpc_port"):
        lines.append(f"gRPC listening on {_host_port(s.grpc_host, ready['grpc_port'])}{tls}")
    if ready.get("grpc_socket"):
        lines.append(f"gRPC listening on unix:{ready['grpc_socket']}")
    if ready.get("session_socket"):
        lines.append(f"session socket listening on unix:{ready['session_socket']}")
    if ready.get("session_socket_tcp_port"):
        where = _host_port(s.grpc_host, ready["session_socket_tcp_port"])
        lines.append(f"session socket listening on TCP {where}")
    if ready.get("ipc_socket"):
        lines.append(f"device-pool fd socket listening on unix:{ready['ipc_socket']}")
    url = f"{'https' if s.tls_cert else 'http'}://{_host_port(s.http_host, ready['http_port'])}"
    lines.append(
        f"HTTP listening on {url}/ (pool map at {url}/, API docs at {url}/docs, "
        f"metrics at {url}/metrics)"
    )
    lines.append(f"host pool in shared memory /dev/shm/{ready['shm_name']}")
    return lines


def serve(settings: Settings) -> int:
    """Run the daemon until SIGTERM/SIGINT; StartupError (or PoolInUseError, OSError) when
    it cannot start, with a message naming what to change."""
    logs.configure(settings.log_level, settings.log_format)
    tune_malloc()  # before the buffers of the data plane are allocated (malloc.py)
    pin_cpus(settings)
    http_sock = preflight(settings)
    try:
        return asyncio.run(Daemon(settings, http_sock).run())
    finally:
        http_sock.close()


def pin_cpus(settings: Settings) -> None:
    """Apply ``cpu_affinity`` to this process before any thread starts (threads inherit
    it). OSError naming the CPUs when some are not this process's to use (it stays as it
    was)."""
    cpus = settings.cpus()
    if cpus is None:
        return
    before = os.sched_getaffinity(0)
    try:  # the mask we inherited does not limit us; the cpuset and the online CPUs do
        os.sched_setaffinity(0, cpus)
        got = os.sched_getaffinity(0)
    except OSError:
        got = set()
    if got != cpus:
        os.sched_setaffinity(0, before)
        raise OSError(
            errno.EINVAL,
            f"--cpu-affinity {settings.cpu_affinity}: CPUs {sorted(cpus - got)} are not "
            "available to this process (offline, or outside its cpuset)",
        )
    log.info("pinned to CPUs %s", settings.cpu_affinity)
