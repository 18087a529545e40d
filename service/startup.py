"""Checks before the daemon starts, each failing with one line that names what to change.

:func:`preflight` runs before the host pool is allocated (which may take minutes to pin):
the TLS files, the Unix socket paths, room in ``/dev/shm``, the gRPC port, and the HTTP
socket, which it binds and hands to the daemon (bound, not yet listening: connections are
refused, not left waiting, until the daemon serves). Anything it refuses is a
:class:`StartupError`; ``embcache serve`` prints it as ``cannot start: ...`` and exits 1.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import ssl
from pathlib import Path

from embcache.proto.constants import SESSION_SOCKET_SUFFIX
from embcache.service.config import Settings
from embcache.service.sizes import format_size
from embcache.service.transport.sockets import prepare_socket_path

SHM_DIR = Path("/dev/shm")
MAX_UNIX_PATH = 107  # sun_path holds 108 bytes, the last one a NUL


class StartupError(Exception):
    """The daemon cannot start as configured; the message says what to change.

    ``setting`` is the Settings field at fault and ``value`` its value (None when no single
    setting is), so the CLI can say where the value came from (a flag or an env var);
    ``str()`` reads ``--flag value: reason``."""

    def __init__(self, reason: str, setting: str | None = None, value: object = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.setting = setting
        self.value = value

    def __str__(self) -> str:
        if self.setting is None:
            return self.reason
        flag = "--" + self.setting.replace("_", "-")
        shown = f"{flag} {self.value}" if self.value is not None else flag
        return f"{shown}: {self.reason}"


def preflight(settings: Settings) -> socket.socket:
    """Check what can be checked before the pool is allocated; returns the bound (not yet
    listening) HTTP socket. StartupError naming the setting at fault."""
    check_tls(settings)
    for setting, path in unix_sockets(settings):
        check_unix_socket(path, setting)
    check_shm_room(settings)
    check_tcp_port_free(settings.grpc_host, settings.grpc_port, "gRPC", "grpc")
    return bind_http(settings)


def unix_sockets(settings: Settings) -> list[tuple[str, Path]]:
    """(setting, path) of each Unix socket the daemon will listen on that is known up front."""
    out = []
    if settings.grpc_socket is not None:
        out.append(("grpc_socket", settings.grpc_socket))
        if settings.session_socket:  # the session socket beside it
            out.append(("grpc_socket", settings.grpc_socket.with_name(
                settings.grpc_socket.name + SESSION_SOCKET_SUFFIX)))  # fmt: skip
    if settings.ipc_socket is not None:  # the fd socket, when set explicitly
        out.append(("ipc_socket", settings.ipc_socket))
    return out


def check_tls(settings: Settings) -> None:
    cert, key = settings.tls_cert, settings.tls_key
    if cert is None or key is None:
        return
    for field, path in (("tls_cert", cert), ("tls_key", key)):
        try:
            path.read_bytes()
        except FileNotFoundError:
            raise StartupError("no such file", field, path) from None
        except IsADirectoryError:
            raise StartupError("is a directory, not a PEM file", field, path) from None
        except PermissionError:
            raise StartupError(
                f"not readable by this user (uid {os.getuid()})", field, path
            ) from None
        except OSError as exc:
            raise StartupError(f"cannot read it ({exc.strerror})", field, path) from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key)
    except (ssl.SSLError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or str(exc)
        raise StartupError(
            f"not a PEM certificate and its private key ({reason}), with --tls-key {key}",
            "tls_cert",
            cert,
        ) from None


def check_unix_socket(path: Path, setting: str) -> None:
    """A path a Unix socket can be bound at: short enough, in a directory this user can
    write (made if missing), with no file or live socket there (a stale socket goes).
    ``setting``: the Settings field that places it (``grpc_socket``, ``ipc_socket``)."""
    size = len(os.fsencode(path))
    if size > MAX_UNIX_PATH:
        raise StartupError(
            f"{size} bytes, longer than a Unix socket path may be ({MAX_UNIX_PATH}); "
            "choose a shorter path",
            setting,
            path,
        )
    try:
        prepare_socket_path(path)
    except FileExistsError:
        raise StartupError(
            "exists and is not a socket; remove it or choose another path", setting, path
        ) from None
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise StartupError(
                "another process listens there (a running daemon?); stop it or choose another path",
                setting,
                path,
            ) from None
        raise StartupError(
            f"cannot create its directory {path.parent} ({exc.strerror})", setting, path
        ) from None
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise StartupError(
            f"its directory {path.parent} is not writable by this user (uid {os.getuid()})",
            setting,
            path,
        )


def check_shm_room(settings: Settings) -> None:
    """Room in /dev/shm for the host pool (a stale segment of ours counts as room)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return  # no /dev/shm to ask: the pool's allocation says what is wrong
    free = st.f_bavail * st.f_frsize
    if settings.shm_name:
        with contextlib.suppress(OSError):
            free += (SHM_DIR / settings.shm_name).stat().st_blocks * 512
    if settings.host_pool_bytes > free:
        raise StartupError(
            f"no room for a {format_size(settings.host_pool_bytes)} host pool in {SHM_DIR} "
            f"({format_size(free)} free): lower --host-pool-bytes or enlarge {SHM_DIR} "
            "(docker run --shm-size; a memory-backed emptyDir in Kubernetes)",
            "host_pool_bytes",
            settings.host_pool_bytes,
        )


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET


def check_tcp_port_free(host: str, port: int, what: str, plane: str) -> None:
    """Refuse a port another process listens on (a probe bind; port 0 is always free).
    ``plane``: ``grpc`` or ``http``, whose ``<plane>_host``/``<plane>_port`` settings these are."""
    if port == 0:
        return
    probe = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server will
        probe.bind((host.strip("[]"), port))
    except OSError as exc:
        raise _bind_error(what, host, port, plane, exc) from None
    finally:
        probe.close()


def bind_http(settings: Settings) -> socket.socket:
    """The HTTP listener's socket, bound (the daemon calls listen once it serves)."""
    host = settings.http_host
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets created with it, and
    # without TCP_NODELAY every response waits ~40 ms on Nagle + delayed ACK.
    sock = socket.socket(_family(host), socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), settings.http_port))
    except OSError as exc:
        sock.close()
        raise _bind_error("HTTP", host, settings.http_port, "http", exc) from None
    sock.setblocking(False)
    return sock


def _bind_error(what: str, host: str, port: int, plane: str, exc: OSError) -> StartupError:
    flag, host_flag = f"--{plane}-port", f"--{plane}-host"
    if exc.errno == errno.EADDRINUSE:
        return StartupError(
            f"{what} port {host}:{port} is in use by another process (a daemon running "
            f"already?): stop it, or choose another {flag} (0 picks a free one)",
            f"{plane}_port",
            port,
        )
    if exc.errno == errno.EACCES:
        return StartupError(
            f"{what} port {host}:{port} needs privileges this user lacks: choose {flag} >= 1024",
            f"{plane}_port",
            port,
        )
    if exc.errno == errno.EADDRNOTAVAIL:
        return StartupError(
            f"{what} address {host} is not one of this machine's: fix {host_flag}",
            f"{plane}_host",
            host,
        )
    return StartupError(
        f"cannot bind {what} to {host}:{port} ({exc.strerror or exc}): check {host_flag}/{flag}",
        f"{plane}_port",
        port,
    )
