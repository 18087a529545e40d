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

from embcache.proto.constants import UDS_SUFFIX
from embcache.service.config import Settings
from embcache.service.sizes import format_size
from embcache.service.transport.sockets import prepare_socket_path

SHM_DIR = Path("/dev/shm")
MAX_UNIX_PATH = 107  # sun_path holds 108 bytes, the last one a NUL


class StartupError(Exception):
    """The daemon cannot start as configured; the message says what to change."""


def preflight(settings: Settings) -> socket.socket:
    """Check what can be checked before the pool is allocated; returns the bound (not yet
    listening) HTTP socket. StartupError naming the setting at fault."""
    check_tls(settings)
    for flag, path in unix_sockets(settings):
        check_unix_socket(path, flag)
    check_shm_room(settings)
    check_tcp_port_free(settings.grpc_host, settings.grpc_port, "gRPC", "--grpc-port")
    return bind_http(settings)


def unix_sockets(settings: Settings) -> list[tuple[str, Path]]:
    """(flag, path) of each Unix socket the daemon will listen on that is known up front."""
    out = []
    if settings.grpc_socket is not None:
        out.append(("--grpc-socket", settings.grpc_socket))
        if settings.uds_sessions:  # the session socket beside it
            out.append(("--grpc-socket", settings.grpc_socket.with_name(
                settings.grpc_socket.name + UDS_SUFFIX)))  # fmt: skip
    if settings.ipc_socket is not None:  # the fd socket, when set explicitly
        out.append(("--ipc-socket", settings.ipc_socket))
    return out


def check_tls(settings: Settings) -> None:
    cert, key = settings.tls_cert, settings.tls_key
    if cert is None or key is None:
        return
    for flag, path in (("--tls-cert", cert), ("--tls-key", key)):
        try:
            path.read_bytes()
        except FileNotFoundError:
            raise StartupError(f"{flag} {path}: no such file") from None
        except IsADirectoryError:
            raise StartupError(f"{flag} {path}: is a directory, not a PEM file") from None
        except PermissionError:
            raise StartupError(
                f"{flag} {path}: not readable by this user (uid {os.getuid()})"
            ) from None
        except OSError as exc:
            raise StartupError(f"{flag} {path}: cannot read it ({exc.strerror})") from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key)
    except (ssl.SSLError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or str(exc)
        raise StartupError(
            f"--tls-cert {cert} / --tls-key {key}: not a PEM certificate and its private "
            f"key ({reason})"
        ) from None


def check_unix_socket(path: Path, flag: str) -> None:
    """A path a Unix socket can be bound at: short enough, in a directory this user can
    write (made if missing), with no file or live socket there (a stale socket goes)."""
    size = len(os.fsencode(path))
    if size > MAX_UNIX_PATH:
        raise StartupError(
            f"{flag} {path}: {size} bytes, longer than a Unix socket path may be "
            f"({MAX_UNIX_PATH}); choose a shorter path"
        )
    try:
        prepare_socket_path(path)
    except FileExistsError:
        raise StartupError(
            f"{flag} {path}: exists and is not a socket; remove it or choose another path"
        ) from None
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise StartupError(
                f"{flag} {path}: another process listens there (a running daemon?); stop it "
                "or choose another path"
            ) from None
        raise StartupError(
            f"{flag} {path}: cannot create its directory {path.parent} ({exc.strerror})"
        ) from None
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise StartupError(
            f"{flag} {path}: its directory {path.parent} is not writable by this user "
            f"(uid {os.getuid()})"
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
            "(docker run --shm-size; a memory-backed emptyDir in Kubernetes)"
        )


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET


def check_tcp_port_free(host: str, port: int, what: str, flag: str) -> None:
    """Refuse a port another process listens on (a probe bind; port 0 is always free)."""
    if port == 0:
        return
    probe = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server will
        probe.bind((host.strip("[]"), port))
    except OSError as exc:
        raise StartupError(_bind_message(what, host, port, flag, exc)) from None
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
        message = _bind_message("HTTP", host, settings.http_port, "--http-port", exc)
        raise StartupError(message) from None
    sock.setblocking(False)
    return sock


def _bind_message(what: str, host: str, port: int, flag: str, exc: OSError) -> str:
    host_flag = "--grpc-host" if flag == "--grpc-port" else "--http-host"
    if exc.errno == errno.EADDRINUSE:
        return (
            f"{what} port {host}:{port} is in use by another process (a daemon running "
            f"already?): stop it, or choose another {flag} (0 picks a free one)"
        )
    if exc.errno == errno.EACCES:
        return f"{what} port {host}:{port} needs privileges this user lacks: choose {flag} >= 1024"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"{what} address {host} is not one of this machine's: fix {host_flag}"
    return f"cannot bind {what} to {host}:{port} ({exc.strerror or exc}): check {host_flag}/{flag}"
