"""Daemon settings: one frozen object built from env vars (``EMBCACHE_*``) and CLI flags.

Sizes accept plain integers or values like ``4GiB``, ``256KiB``, ``1.5GB``.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from embcache.service.sizes import parse_cpu_list, parse_size
from embcache.service.tier_config import SharedTierConfig

ByteSize = Annotated[int, BeforeValidator(parse_size)]

# Old setting names -> new ones; the old still work for one release (CHANGELOG).
DEPRECATED_NAMES = {
    "session_lane": "uds_sessions",
    "device_put_landing_bytes": "device_put_prealloc_bytes",
}
log = logging.getLogger("embcache.config")

_LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}
SHM_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")  # a file name under /dev/shm
# An HTTP Host (a DNS name, an IPv4 address or a bracketed IPv6 one, and an optional port),
# and an origin (http or https, then such a Host).
_HOST_PORT = re.compile(
    r"(?:[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,252})|\[[0-9A-Fa-f:.]+\])(?::\d{1,5})?"
)
_ORIGIN = re.compile(r"https?://" + _HOST_PORT.pattern)


def is_loopback(host: str) -> bool:
    """True for loopback addresses (127.0.0.0/8, ::1) and ``localhost``; not for names that
    merely start with "127." (``127.foo.example`` resolves wherever DNS says)."""
    if host in _LOOPBACK_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class Settings(BaseSettings):
    """Everything the daemon can be told. Env var ``EMBCACHE_<FIELD>`` or flag ``--<field>``."""

    model_config = SettingsConfigDict(
        env_prefix="EMBCACHE_", frozen=True, extra="forbid", validate_default=True
    )

    # Pools
    host_pool_bytes: ByteSize = Field(
        1024**3, description="Size of the host page pool (shared memory; pinned on CUDA machines)."
    )
    page_bytes: ByteSize = Field(256 * 1024, description="Host page size in bytes.")
    max_entry_bytes: ByteSize = Field(
        256 * 1024**2, description="Largest entry accepted; larger puts fail before reserving."
    )
    device_pool_bytes: ByteSize = Field(
        0, description="Device (HBM) pool size per GPU; 0 disables the device tier."
    )
    device_page_bytes: ByteSize = Field(256 * 1024, description="Device page size in bytes.")
    device_put_prealloc_bytes: ByteSize = Field(
        64 * 1024**2,
        description="Host memory set aside for puts from a device (at most 1/16 of the host "
        "pool): such a put takes its pages from it and queues its copy before it is checked "
        "and recorded (0: off). Counted as free; taken back whenever room is short.",
    )
    device_free_reserve: float = Field(
        1 / 16,
        ge=0,
        le=0.5,
        description="Share of each device pool kept free: after a Get, least recently used "
        "unleased copies are evicted until this much is free, so a cold Get of up to that "
        "size takes its pages without evicting on its path (0: evict only on demand).",
    )
    device_table_flush_s: float = Field(
        0.025,
        ge=0,
        le=1.0,
        description="Longest a device pool's page-table updates wait to be launched together "
        "(0: after every Get). Copies never read the tables and a reader flushes first; "
        "fewer launches take fewer GPU time slices from decoders in other processes.",
    )
    shm_name: str = Field(
        "",
        description="Name of the POSIX shared-memory segment of the host pool (empty: "
        "'embcache-<port>-<random>', created exclusively; the ready line names it).",
    )
    warm_restart: bool = Field(
        True,
        description="on: a restarted daemon adopts the READY entries its predecessor left in "
        "the segment --shm-name names (or the newest stale 'embcache-<port>-*' one), if its "
        "index has this layout, page size and pool size, and SIGTERM leaves the segment and "
        "its index in place; off: every start is cold and SIGTERM removes the segment "
        "(docs/restart.md).",
    )
    gpus: str = Field(
        "all",
        description="GPUs that get a device pool: 'all' visible ones, or indices like '0,2'.",
    )
    ipc_mode: Literal["fd", "legacy"] = Field(
        "fd",
        description="How device pools are shared: 'fd' (VMM, POSIX fd over a Unix socket; "
        "containers share only the socket directory) or 'legacy' (cudaIpcMemHandle; "
        "containers must share IPC and PID namespaces).",
    )
    ipc_socket: Path | None = Field(
        None,
        description="Unix socket that hands device-pool file descriptors to clients "
        "(empty: '<grpc_socket>.fds', or /tmp/embcache-<port>.fds).",
    )
    shm_mode: str = Field(
        "0600",
        description="Permissions (octal) of the host pool's shared-memory segment; e.g. 0640 "
        "lets the segment's group map it read-only for zero-copy gets.",
    )
    socket_mode: str = Field(
        "0660", description="Permissions (octal) of the gRPC and fd Unix sockets."
    )
    read_table: bool = Field(
        True,
        description="Publish READY entries in a read-only table beside the segment, so "
        "clients on the node that map the pool copy small entries out of it with no call "
        "(docs/same_node_reads.md); off: every get is a call.",
    )
    # Entries and leases
    max_key_bytes: int = Field(1024, ge=1, le=65536, description="Longest key, in UTF-8 bytes.")
    lease_ttl_s: float = Field(
        60.0, gt=0, description="Lease lifetime unless released or renewed, in seconds."
    )
    max_lease_ttl_s: float = Field(
        3600.0, gt=0, description="Longest lease lifetime a client may ask for, in seconds."
    )
    max_inflight_bytes_per_client: ByteSize = Field(
        0, description="Bytes one client may have reserved in unfinished puts (0 = pool size)."
    )
    # Fair sharing (docs/reliability.md, "One client against the others")
    put_idle_timeout_s: float = Field(
        30.0, gt=0, le=3600, description="A put that receives no bytes for this long is "
        "aborted and its pages freed (gRPC Put streams, REST PUT bodies).",
    )  # fmt: skip
    max_entries: int = Field(
        0, ge=0, description="Most entries, zero-byte ones included; past it the least recently "
        "used are evicted (0: host pages + 1024).",
    )  # fmt: skip
    max_leases_per_owner: int = Field(
        16384, ge=1, description="Most leases one owner (a session, a peer) may hold at once."
    )
    max_leased_bytes_per_owner: ByteSize = Field(
        0, description="Most bytes of distinct entries one owner may hold leased at once "
        "(0: half the host pool, at least one largest entry).",
    )  # fmt: skip
    max_session_calls: int = Field(
        128, ge=1, le=65536, description="Calls one session may have in flight; past it the "
        "daemon stops reading that session's requests until one finishes.",
    )  # fmt: skip
    max_request_body_bytes: ByteSize = Field(
        1024**2, ge=1024, description="Largest JSON body of a REST control route (413 past "
        "it); PUT data bodies stream into pages and are bounded by the entry size.",
    )  # fmt: skip
    session_hello_timeout_s: float = Field(
        5.0, gt=0, le=600, description="A session-socket connection (Unix or TCP) that has not "
        "sent an accepted hello (with the token, when the daemon has one) this long after it "
        "connected is closed.",
    )  # fmt: skip
    session_hello_max_bytes: ByteSize = Field(
        4096, ge=256, le=1024**2, description="Largest message the session socket reads from a "
        "connection before its hello is accepted (at least the auth token's length plus 1 KiB); "
        "a larger one closes the connection before it is buffered.",
    )  # fmt: skip
    max_session_connections: int = Field(
        1024, ge=1, le=1_000_000, description="Most connections the session socket keeps open "
        "(Unix and TCP together, authenticated or not; never more than half the process's "
        "open-file limit); at it a new connection takes the place of the one that has waited "
        "longest for its hello (closed), or is refused and closed when every place is a "
        "session; sessions are never closed to make room.",
    )  # fmt: skip
    touch_window_s: float = Field(
        1.0, ge=0, le=3600, description="A client's posted touches (hits it served from the "
        "read table; its sessions together) count each key at most once per window of this "
        "many seconds, as a hit "
        "and as a move to the LRU's recent end (0: every time).",
    )  # fmt: skip
    max_touch_keys_per_s: int = Field(
        65536, ge=1, description="Keys one client (its sessions together: a process on the "
        "session socket, else an address) may report in touches per second (a burst "
        "of one second's worth); a touch past it is dropped whole and counted "
        "(embcache_touches_dropped_total), and the session goes on.",
    )  # fmt: skip
    max_quarantine_bytes_per_owner: ByteSize = Field(
        0,
        description="Pages one client process may keep held by views of leases that ended by "
        "force (a TTL, a dropped session) until it exits or drops the views; past it, its gets "
        "are refused with QuotaExceeded (0 = a quarter of the host pool).",
    )
    # Listeners
    grpc_host: str = Field("127.0.0.1", description="gRPC TCP bind address.")
    grpc_port: int = Field(7470, ge=0, le=65535, description="gRPC TCP port (0 = pick a free one).")
    grpc_socket: Path | None = Field(
        None, description="gRPC Unix socket path (none: no Unix socket listener)."
    )
    uds_sessions: bool = Field(
        True,
        description="With a gRPC Unix socket PATH, also serve Session calls on the session "
        "socket PATH.lane (length-prefixed messages without HTTP/2: a same-node round trip "
        "costs a fraction of gRPC's; docs/grpc.md). Same permissions and token as the gRPC "
        "socket.",
    )
    tcp_lane: bool = Field(
        True,
        description="Also serve the session socket's framing on TCP, at grpc_host and "
        "tcp_lane_port, for clients that reach gRPC over TCP; get_bytes sends its bytes raw "
        "there (docs/grpc.md, 'The session socket on TCP'). Off with TLS, which it does not "
        "speak; with an auth_token the hello must carry it.",
    )
    tcp_lane_port: int = Field(
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
    # Kernels / devices
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="'auto' uses CUDA when present, else CPU mode."
    )
    copy_sm_budget: int = Field(
        16, ge=1, le=1024, description="Most programs the copy kernel may run at once."
    )
    copy_backend: Literal["auto", "kernel", "batch", "memcpy", "torch"] = Field(
        "auto", description="transfer_ranges backend: auto, kernel, batch, memcpy, torch."
    )
    # Shared tier (service/shared_tier/; docs/scale-out.md)
    shared_tier: str | None = Field(
        None,
        description="Shared tier URL: redis://host:port[,host:port...][/db] | rediss://... | "
        "mooncake://master:port; adapter options in the query string. None: off.",
    )
    shared_tier_ack: Literal["async", "sync"] = Field(
        "async", description="sync: a put returns once the shared tier has the entry."
    )
    shared_tier_queue: int = Field(1024, ge=1, description="Write-through queue length (entries).")
    shared_tier_timeout_s: float = Field(
        2.0,
        gt=0,
        description="Per shared-tier operation; also the longest a put waits on a full "
        "write-through queue.",
    )
    shared_tier_retries: int = Field(
        3, ge=0, description="Write-through retries before an entry is left out of the tier."
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Log level."
    )
    log_format: Literal["text", "json"] = Field(
        "text",
        description="Format of the log lines on stderr, uvicorn's included: text, or json "
        "(one object a line: time, level, logger, message).",
    )

    @field_validator("page_bytes", "device_page_bytes")
    @classmethod
    def _page_size(cls, v: int) -> int:
        if v < 4096 or v & (v - 1):
            raise ValueError("must be a power of two of at least 4096 bytes")
        return v

    @field_validator("shm_name")
    @classmethod
    def _shm_name(cls, v: str) -> str:
        if v and not SHM_NAME.match(v):
            raise ValueError("use 1-200 letters, digits, '.', '_' or '-'")
        if v.endswith((".index", ".tmp")):
            raise ValueError("names ending in .index or .tmp are the warm-restart index's")
        return v

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
        form = _ORIGIN if info.field_name == "http_allowed_origins" else _HOST_PORT
        entries = [x.strip() for x in v.split(",") if x.strip()]
        bad = [x for x in entries if x != "*" and not form.fullmatch(x)]
        if bad:
            shape = "scheme://host[:port]" if form is _ORIGIN else "NAME or NAME:PORT"
            raise ValueError(f"{', '.join(bad)}: each entry is {shape} or '*'")
        return ",".join(entries)

    @field_validator("gpus")
    @classmethod
    def _gpu_list(cls, v: str) -> str:
        if v.strip() == "all":
            return "all"
        try:
            ids = [int(x) for x in v.split(",") if x.strip()]
        except ValueError:
            raise ValueError("must be 'all' or comma-separated GPU indices like 0,1") from None
        if not ids or min(ids) < 0 or len(set(ids)) != len(ids):
            raise ValueError("must list distinct, non-negative GPU indices")
        return ",".join(str(i) for i in ids)

    def gpu_indices(self, visible: int) -> list[int]:
        """The GPUs to serve, given how many are visible."""
        if self.gpus == "all":
            return list(range(visible))
        ids = [int(x) for x in self.gpus.split(",")]
        if max(ids) >= visible:
            raise ValueError(f"gpus={self.gpus} but only {visible} GPUs are visible")
        return ids

    @field_validator("cpu_affinity")
    @classmethod
    def _cpu_list(cls, v: str) -> str:
        return ",".join(str(c) for c in sorted(parse_cpu_list(v)))

    def cpus(self) -> set[int] | None:
        """The CPUs of ``cpu_affinity``, or None when it is empty."""
        return parse_cpu_list(self.cpu_affinity) or None

    @field_validator("shm_mode", "socket_mode")
    @classmethod
    def _octal_mode(cls, v: str) -> str:
        try:
            mode = int(v, 8)
        except ValueError:
            raise ValueError("must be an octal permission like 0660") from None
        if not 0 <= mode <= 0o777 or mode & 0o111:
            raise ValueError("must be a permission without execute bits, at most 0666")
        return v

    @field_validator("shm_mode")
    @classmethod
    def _owner_writes(cls, v: str) -> str:
        # Clients map the pool read-only; a segment others may write is a cache anyone
        # on the node can corrupt under every reader.
        if int(v, 8) & 0o022:
            raise ValueError("must not let group or others write the segment (e.g. 0600, 0640)")
        return v

    @field_validator("host_pool_bytes")
    @classmethod
    def _pool_size(cls, v: int) -> int:
        if v <= 0:
            raise ValueError("must be positive")
        return v

    @field_validator("shared_tier")
    @classmethod
    def _tier_url(cls, v: str | None) -> str | None:
        if v:
            SharedTierConfig.from_url(v)  # raises ValueError naming what is wrong
        return v or None

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        """Settings under their old names (arguments or ``EMBCACHE_<OLD>`` env vars) still
        work for one release, with a log line naming the new one."""
        if not isinstance(data, dict):
            return data
        for old, new in DEPRECATED_NAMES.items():
            env = os.environ.get(f"EMBCACHE_{old.upper()}")
            value = data.pop(old, None)
            if value is None and env is not None and new not in data:
                value = env
            if value is not None:
                log.warning("setting %r is deprecated: use %r", old, new)
                data.setdefault(new, value)
        return data

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if self.host_pool_bytes % self.page_bytes:
            raise ValueError(
                f"host_pool_bytes ({self.host_pool_bytes}) must be a multiple of "
                f"page_bytes ({self.page_bytes})"
            )
        if self.host_pool_bytes < self.page_bytes:
            raise ValueError("host_pool_bytes must hold at least one page")
        if self.device_pool_bytes % self.device_page_bytes:
            raise ValueError("device_pool_bytes must be a multiple of device_page_bytes")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca (mTLS) needs tls_cert and tls_key")
        exposed = [
            f"{name}={host}"
            for name, host in (("grpc_host", self.grpc_host), ("http_host", self.http_host))
            if not is_loopback(host)
        ]
        if exposed and not self.auth_token and self.tls_client_ca is None:
            raise ValueError(
                f"non-loopback bind ({', '.join(exposed)}) needs auth_token, or mTLS "
                "(tls_cert, tls_key and tls_client_ca): TLS alone encrypts but lets anyone in"
            )
        return self

    @property
    def shm_prefix(self) -> str:
        """Segments without a ``shm_name`` are ``<this>-<random>`` (``unique_host_pool``)."""
        return f"embcache-{self.grpc_port}"

    @property
    def effective_ipc_socket(self) -> Path:
        """The fd socket's path: ``ipc_socket``, else beside the gRPC socket, else in /tmp."""
        if self.ipc_socket is not None:
            return self.ipc_socket
        if self.grpc_socket is not None:
            return self.grpc_socket.with_name(self.grpc_socket.name + ".fds")
        return Path(f"/tmp/embcache-{self.grpc_port}.fds")

    @property
    def num_host_pages(self) -> int:
        """Pages in the host pool."""
        return self.host_pool_bytes // self.page_bytes

    @property
    def inflight_limit(self) -> int:
        """Bytes one owner may hold in unfinished puts (0 in the settings: the pool size)."""
        return self.max_inflight_bytes_per_client or self.host_pool_bytes

    @property
    def entry_limit(self) -> int:
        """Most entries (0 in the settings: one per host page, plus 1024 zero-byte ones)."""
        return self.max_entries or self.num_host_pages + 1024

    @property
    def leased_bytes_limit(self) -> int:
        """Bytes one owner may hold leased (0 in the settings: half the host pool, and never
        less than the largest entry the pool takes, so any entry can be read)."""
        largest = min(self.max_entry_bytes, self.host_pool_bytes)
        return self.max_leased_bytes_per_owner or max(self.host_pool_bytes // 2, largest)

    @property
    def quarantine_limit(self) -> int:
        """Bytes one process may keep quarantined (0 in the settings: a quarter of the pool)."""
        return self.max_quarantine_bytes_per_owner or self.host_pool_bytes // 4

    def device_config(self) -> DeviceConfig:
        """The settings the device tier needs, and no others."""
        return DeviceConfig(
            copy_backend=self.copy_backend,
            sm_budget=self.copy_sm_budget,
            free_reserve=self.device_free_reserve,
            table_flush_s=self.device_table_flush_s,
        )


@dataclass(frozen=True, slots=True)
class DeviceConfig:
    """The device tier's view of the settings (``Settings.device_config``)."""

    copy_backend: Literal["auto", "kernel", "batch", "memcpy", "torch"]  # or forced
    sm_budget: int  # most programs a copy kernel runs with
    free_reserve: float  # share of each pool kept free after cold gets
    table_flush_s: float  # longest page-table updates wait to be launched together
