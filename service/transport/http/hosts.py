"""Which ``Host`` and ``Origin`` headers the HTTP plane answers: its defence against DNS
rebinding and cross-site writes.

A web page on ``attacker.example`` whose name the attacker re-points at 127.0.0.1 becomes
same-origin with the daemon in the browser's eyes: without this check it could list keys,
read entries' bytes and evict the cache. The browser still sends ``Host: attacker.example``,
so the daemon answers only the names it serves: ``localhost``, ``127.0.0.1``, ``[::1]``, its
bind address and the address the request arrived on (an address the machine has), each with
the port the request arrived on (or none); with a non-loopback bind, also the machine's host
name; plus the operator's list (``http_allowed_hosts``). A request without ``Host``
(HTTP/1.0) comes from no browser and passes.

A browser's write from another site (``POST /v1/evict`` from a page on localhost:8000) carries
``Host: localhost:7471``, which is fine, but ``Origin: http://localhost:8000``: state-changing
methods are refused when they carry an ``Origin`` that is neither the request's own
(``scheme://Host``) nor on ``http_allowed_origins``.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass

from embcache.service.config import Settings, is_loopback

WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_AUTHORITY = re.compile(
    r"(?P<name>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]{1,253})(?::(?P<port>\d{1,5}))?"
)
_ORIGIN = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?P<authority>[^/?#]*)")
_DEFAULT_PORTS = {"http": 80, "https": 443}
_UNSPECIFIED = {"0.0.0.0", "::", "*", ""}  # binds to every address; no name to serve


@dataclass(frozen=True, slots=True)
class Authority:
    """A host name (normalized) and a port (None when the header gave none)."""

    name: str
    port: int | None


def normalize_name(name: str) -> str:
    """Lower case, no trailing dot, IPv6 without brackets, IPv4-mapped IPv6 as IPv4."""
    name = name.strip().lower().removesuffix(".")
    bare = name.removeprefix("[").removesuffix("]")
    try:
        address = ipaddress.ip_address(bare)
    except ValueError:
        return name
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


def parse_authority(text: str) -> Authority | None:
    """``host[:port]`` as a Host header or an origin carries it; None when malformed."""
    match = _AUTHORITY.fullmatch(text)
    if match is None:
        return None
    port = match.group("port")
    if port is not None and not 0 < int(port) < 65536:
        return None
    return Authority(normalize_name(match.group("name")), int(port) if port else None)


class HostPolicy:
    """The allow-lists of one daemon's HTTP plane, built once from its settings."""

    def __init__(self, settings: Settings) -> None:
        hosts = [h for h in settings.http_allowed_hosts.split(",") if h]
        self.any_host = "*" in hosts
        own = {"localhost", "127.0.0.1", "::1"}
        bind = settings.http_host.strip()
        if bind not in _UNSPECIFIED:
            own.add(normalize_name(bind))
        if not is_loopback(bind):  # served beyond this machine: its own names too
            own.update(normalize_name(n) for n in (socket.gethostname(), socket.getfqdn()) if n)
        self._own = frozenset(own)
        self._any_port: set[str] = set()
        self._exact: set[Authority] = set()
        for entry in hosts:
            parsed = parse_authority(entry) if entry != "*" else None
            if parsed is None:
                continue
            if parsed.port is None:
                self._any_port.add(parsed.name)
            else:
                self._exact.add(parsed)
        origins = [o for o in settings.http_allowed_origins.split(",") if o]
        self.any_origin = "*" in origins
        self._origins = {o for o in map(_parse_origin, origins) if o is not None}

    def names(self) -> list[str]:
        """The names allowed with the daemon's port (for the log line at start-up)."""
        return sorted(self._own | self._any_port) + sorted(
            f"{a.name}:{a.port}" for a in self._exact
        )

    def host_allowed(
        self, host: str | None, scheme: str, server: tuple[str, int | None] | None
    ) -> bool:
        """Whether a request with this ``Host`` (None: absent) reached a name we serve;
        ``server`` is the local address and port the request arrived on."""
        if host is None or self.any_host:
            return True
        authority = parse_authority(host)
        if authority is None:
            return False
        if authority.name in self._any_port:
            return True
        port = authority.port if authority.port is not None else _DEFAULT_PORTS.get(scheme)
        if Authority(authority.name, port) in self._exact:
            return True
        local_name, local_port = (normalize_name(server[0]), server[1]) if server else (None, None)
        ours = authority.name in self._own or authority.name == local_name
        # No port: no browser sends that to a port other than its scheme's default, and the
        # name is ours; a raw client writing "Host: 127.0.0.1" is served.
        return ours and (authority.port is None or local_port is None or port == local_port)

    def origin_allowed(self, origin: str, host: str | None, scheme: str) -> bool:
        """Whether a write carrying ``Origin: origin`` may proceed: the request's own origin
        (same scheme and Host) or one the operator listed."""
        if self.any_origin:
            return True
        parsed = _parse_origin(origin)
        if parsed is None:  # "null" (sandboxed frames, file: pages) and anything malformed
            return False
        if parsed in self._origins:
            return True
        own = parse_authority(host) if host is not None else None
        if own is None:
            return False
        own_port = own.port if own.port is not None else _DEFAULT_PORTS.get(scheme)
        return parsed == (scheme, own.name, own_port)

    def origin_listed(self, origin: str) -> bool:
        """Whether the operator allowed ``origin`` (``http_allowed_origins``)."""
        return self.any_origin or _parse_origin(origin) in self._origins


def _parse_origin(text: str) -> tuple[str, str, int | None] | None:
    """``scheme://host[:port]`` -> (scheme, name, port with the scheme's default filled in)."""
    match = _ORIGIN.fullmatch(text.strip())
    if match is None:
        return None
    scheme = match.group("scheme").lower()
    authority = parse_authority(match.group("authority"))
    if authority is None:
        return None
    port = authority.port if authority.port is not None else _DEFAULT_PORTS.get(scheme)
    return scheme, authority.name, port
