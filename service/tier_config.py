"""``SharedTierConfig``: the shared tier's settings, parsed from one URL plus a few knobs.

URLs (adapter options ride in the query string, so ``Settings`` needs only a few fields):

- ``redis://[user:password@]host:port[,host:port...][/db][?cluster=auto|yes|no&chunk=4MiB
  &ttl=0&prefix=embcache:]`` — several hosts, or one host that answers ``cluster_enabled:1``,
  use the cluster-aware client; ``rediss://`` uses TLS.
- ``mooncake://master:port[?segment=0&buffer=64MiB&protocol=tcp&metadata=P2PHANDSHAKE
  &host=<this node's address>&device=&prefix=embcache/]`` — ``segment`` is the memory this
  daemon lends to the store (0: a pure client; storage nodes lend it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import parse_qsl, unquote, urlsplit

from embcache.service.sizes import parse_size

Backend = Literal["redis", "mooncake"]
Ack = Literal["async", "sync"]


def _split_hosts(netloc: str, default_port: int) -> tuple[tuple[str, int], ...]:
    hosts: list[tuple[str, int]] = []
    for part in netloc.split(","):
        part = part.strip()
        if not part:
            continue
        if part.startswith("["):  # [v6]:port
            host, _, rest = part[1:].partition("]")
            port = int(rest[1:]) if rest.startswith(":") else default_port
        else:
            host, sep, port_s = part.rpartition(":")
            if not sep:
                host, port_s = part, ""
            port = int(port_s) if port_s else default_port
        if not host or not 0 < port < 65536:
            raise ValueError(f"bad host:port {part!r} in shared tier URL")
        hosts.append((host, port))
    if not hosts:
        raise ValueError("shared tier URL names no host")
    return tuple(hosts)


@dataclass(frozen=True, slots=True)
class SharedTierConfig:
    """The shared tier's settings: where the store is (from the URL) and the write-through
    knobs (from ``Settings``); the password never shows in ``repr``."""

    backend: Backend
    hosts: tuple[tuple[str, int], ...]
    tls: bool = False
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    db: int = 0
    options: tuple[tuple[str, str], ...] = ()  # adapter options from the query string
    ack: Ack = "async"  # sync: a put returns once the shared tier has the entry (or gave up)
    queue_size: int = 1024  # write-through queue, in entries (keys; bytes stay in the pool)
    timeout_s: float = 2.0  # per store operation; also the longest a put waits on a full queue
    retries: int = 3  # write attempts after the first, with backoff, before an entry is dropped
    probe_interval_s: float = 0.5  # how often a degraded tier is probed for recovery
    batch_max: int = 32  # entries per write-through batch

    @classmethod
    def from_url(cls, url: str, **knobs: Any) -> SharedTierConfig:
        """Parse a URL (module docstring) plus knobs; ValueError naming what is wrong."""
        parts = urlsplit(url.strip())
        scheme = parts.scheme.lower()
        if scheme in ("redis", "rediss"):
            backend: Backend = "redis"
            default_port = 6379
        elif scheme == "mooncake":
            backend = "mooncake"
            default_port = 50051
        else:
            raise ValueError(f"unknown shared tier scheme {scheme!r} (redis, rediss, mooncake)")
        netloc = parts.netloc
        userinfo, at, hostpart = netloc.rpartition("@")
        if not at:
            userinfo, hostpart = "", netloc
        user, _, password = userinfo.partition(":")
        path = parts.path.strip("/")
        db = int(path) if backend == "redis" and path else 0
        cfg = cls(
            backend=backend,
            hosts=_split_hosts(hostpart, default_port),
            tls=scheme == "rediss",
            username=unquote(user) or None,
            password=unquote(password) or None,
            db=db,
            options=tuple(parse_qsl(parts.query)),
            **knobs,
        )
        cfg.validate()
        return cfg

    @classmethod
    def from_settings(cls, settings: Any) -> SharedTierConfig | None:
        """From ``Settings`` fields ``shared_tier*`` (None when the tier is off)."""
        url = getattr(settings, "shared_tier", None)
        if not url:
            return None
        knobs: dict[str, Any] = {}
        for name, attr in (
            ("ack", "shared_tier_ack"),
            ("queue_size", "shared_tier_queue"),
            ("timeout_s", "shared_tier_timeout_s"),
            ("retries", "shared_tier_retries"),
        ):
            value = getattr(settings, attr, None)
            if value is not None:
                knobs[name] = value
        return cls.from_url(url, **knobs)

    def validate(self) -> None:
        """ValueError unless the knobs are in range and mooncake:// names one master."""
        if self.ack not in ("async", "sync"):
            raise ValueError(f"ack must be 'async' or 'sync', not {self.ack!r}")
        if self.queue_size < 1 or self.batch_max < 1 or self.retries < 0:
            raise ValueError("queue_size and batch_max must be >= 1, retries >= 0")
        if not (self.timeout_s > 0 and self.probe_interval_s > 0):
            raise ValueError("timeout_s and probe_interval_s must be positive")
        if self.backend == "mooncake" and len(self.hosts) != 1:
            raise ValueError("mooncake:// takes one master address")

    def option(self, name: str, default: str) -> str:
        """An adapter option from the query string (the last one given wins)."""
        for key, value in reversed(self.options):
            if key == name:
                return value
        return default

    def size_option(self, name: str, default: int) -> int:
        """A size option (``4MiB``) in bytes."""
        return parse_size(self.option(name, str(default)))

    def redacted_url(self) -> str:
        """The store's URL without credentials or options, for logs and health pages."""
        hosts = ",".join(f"{h}:{p}" for h, p in self.hosts)
        scheme = "rediss" if self.tls else self.backend
        return f"{scheme}://{hosts}"
