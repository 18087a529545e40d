"""The listener settings: where gRPC, the session socket and HTTP listen, and who may call.

A group of fields that ``Settings`` is assembled from, with the checks that need only these
fields (the token, the HTTP Host and origin lists, the CPU list). The checks across groups
(a non-loopback bind needs a token or mTLS) are ``Settings``' own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, field_validator

from embcache.service.config.forms import HOST_PORT, ORIGIN, ByteSize
from embcache.service.sizes import parse_cpu_list


class ListenerSettings(BaseModel):
    """Listeners, authentication, TLS, draining and CPU placement (part of ``Settings``;
    every field is ``EMBCACHE_<FIELD>`` or ``--<field>``)."""

    grpc_host: str = Field("127.0.0.1", description="gRPC TCP bind address.")
    grpc_port: int = Field(7470, ge=0, le=65535, description="gRPC TCP port (0 = pick a free one).")
    grpc_socket: Path | None = Field(
        None, description="gRPC Unix socket path (none: no Unix socket listener)."
    )
    session_socket: bool = Field(
        True,
        description="With a gRPC Unix socket PATH, also serve Session calls on the session "
        "socket PATH.lane (length-prefixed messages without HTTP/2: a same-node round trip "
        "costs a fraction of gRPC's; docs/grpc.md). Same permissions and token as the gRPC "
        "socket.",
    )
    session_socket_tcp: bool = Field(
        True,
        description="Also serve the session socket's framing on TCP, at grpc_host and "
        "session_socket_tcp_port, for clients that reach gRPC over TCP; get_bytes sends its "
        "bytes raw there (docs/grpc.md, 'The session socket on TCP'). Off with TLS, which it "
        "does not speak; with an auth_token the hello must carry it.",
    )
    session_socket_tcp_port: int = Field(
        0, ge=0, le=65535,
        description="TCP port of the session socket on TCP (0 = pick a free one; clients "
        "learn it from the Lanes RPC).",
    )  # fmt: skip
    http_host: str = Field("127.0.0.1", description="HTTP bind address.")
    http_port: int = Field(7471, ge=0, le=65535, description="HTTP port (0 = pick a free one).")
    http_allowed_hosts: str = Field(
        "",
        description="Comma-separated Host names the HTTP plane answers besides its own "
        "(localhost, 127.0.0.1, [::1], the bind address and the address a request arrived "
        "on, each with the daemon's port; with a non-loopback bind also the machine's host "
        "name). NAME allows any port, NAME:PORT that port (a tunnel, a proxy); '*' turns the "
        "check off. Other Hosts get 403: a DNS-rebinding page is refused (docs/operators.md).",
    )
    http_allowed_origins: str = Field(
        "",
        description="Comma-separated origins (scheme://host[:port]) besides the daemon's own "
        "that may send POST, PUT, PATCH and DELETE from a browser; '*' allows any (not "
        "advised). Other Origin headers get 403.",
    )
    http_header_timeout_s: float = Field(
        5.0, gt=0, le=300,
        description="Seconds a connection has to send a complete request head (request line "
        "and headers), counted from when it opens or its last response ends; then it is "
        "closed (with 408 when part of a head came).",
    )  # fmt: skip
    http_max_head_bytes: ByteSize = Field(
        64 * 1024, ge=1024, le=16 * 1024**2,
        description="Largest request head (request line and headers) the HTTP plane reads; "
        "past it the connection is answered 431 and closed.",
    )  # fmt: skip
    http_keepalive_timeout_s: float = Field(
        5.0, gt=0, le=3600,
        description="Seconds an idle keep-alive HTTP connection stays open after a response.",
    )  # fmt: skip
    http_max_concurrency: int = Field(
        1024, ge=1,
        description="Open HTTP connections (or requests in progress) beyond which a new "
        "request is answered 503 Unavailable at once; past twice it (at most a quarter of "
        "the open-file limit) a new connection is closed as it opens.",
    )  # fmt: skip
    auth_token: str | None = Field(
        None, description="Shared secret required on gRPC metadata and HTTP headers."
    )
    tls_cert: Path | None = Field(None, description="TLS certificate (PEM) for gRPC and HTTP.")
    tls_key: Path | None = Field(None, description="TLS private key (PEM).")
    tls_client_ca: Path | None = Field(
        None,
        description="CA certificates (PEM) that client certificates must chain to: with it, "
        "the gRPC and HTTP listeners require and verify a client certificate (mTLS).",
    )
    drain_grace_s: float = Field(
        10.0, ge=0, description="Seconds SIGTERM waits for in-flight calls."
    )
    cpu_affinity: str = Field(
        "",
        description="CPUs the daemon runs on, e.g. '2-3' or '2,3' (empty: wherever the "
        "scheduler puts it). Fixed cores keep a latency-bound daemon's caches warm; pin "
        "clients to other cores (docs/operators.md).",
    )
    busy_poll_us: int = Field(
        5000,
        ge=0,
        le=1_000_000,
        description="After each gRPC call the event loop polls without sleeping for this "
        "many microseconds, so the next call of a burst skips the loop's wake-up "
        "(docs/operators.md, CPU placement). Costs up to one core while calls keep coming, "
        "none when idle; 0 turns it off.",
    )

    @field_validator("auth_token")
    @classmethod
    def _token(cls, v: str | None) -> str | None:
        if v and (v != v.strip() or not v.isprintable() or " " in v):
            raise ValueError("holds spaces or control characters (a newline from a file?)")
        return v

    @field_validator("http_allowed_hosts", "http_allowed_origins")
    @classmethod
    def _http_names(cls, v: str, info: Any) -> str:
        # A typo here locks operators out (or lets pages in): refuse it at start-up.
        form = ORIGIN if info.field_name == "http_allowed_origins" else HOST_PORT
        entries = [x.strip() for x in v.split(",") if x.strip()]
        bad = [x for x in entries if x != "*" and not form.fullmatch(x)]
        if bad:
            shape = "scheme://host[:port]" if form is ORIGIN else "NAME or NAME:PORT"
            raise ValueError(f"{', '.join(bad)}: each entry is {shape} or '*'")
        return ",".join(entries)

    @field_validator("cpu_affinity")
    @classmethod
    def _cpu_list(cls, v: str) -> str:
        return ",".join(str(c) for c in sorted(parse_cpu_list(v)))

    def cpus(self) -> set[int] | None:
        """The CPUs of ``cpu_affinity``, or None when it is empty."""
        return parse_cpu_list(self.cpu_affinity) or None
