"""Redis / Redis Cluster adapter (redis-py).

Each entry is a *head* key ``<prefix>{<digest>}`` holding the 256-byte header and the first
chunk of the payload; payloads larger than ``chunk`` bytes continue in keys
``<prefix>{<digest>}:<gen>:<i>``. The ``{digest}`` hash tag puts every chunk of an entry in
the head's slot, so one cluster node serves the whole entry while entries spread over the
cluster. Chunks are written before the head (same node, one pipeline, in order), and ``gen``
is random per write, so a reader that finds a head always finds that write's chunks, and
two concurrent writes of one key never mix. Big values are chunked because Redis serves
one command at a time: a 50 MB SET would stall every other client of that node.

Several hosts, or one host that reports ``cluster_enabled:1``, give the cluster-aware
client; otherwise plain ``redis.Redis``. The client is built lazily, so a daemon started
during an outage connects once the store is back.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from embcache.service.shared_tier.base import (
    HEADER_BYTES,
    FetchResult,
    Header,
    PutItem,
    Reserve,
    SharedTierBackend,
    TierError,
    key_digest,
    scatter,
)
from embcache.service.tier_config import SharedTierConfig

DEFAULT_CHUNK = 4 * 1024 * 1024


class RedisTier(SharedTierBackend):
    """Redis or Redis Cluster through redis-py (module docstring); connects lazily."""

    name = "redis"

    def __init__(self, config: SharedTierConfig) -> None:
        import redis  # optional dependency (extra "shared-tier")

        self._redis = redis
        self.config = config
        self.prefix = config.option("prefix", "embcache:")
        self.chunk_bytes = config.size_option("chunk", DEFAULT_CHUNK)
        if self.chunk_bytes < 4096:
            raise ValueError("redis chunk size must be at least 4096 bytes")
        ttl = float(config.option("ttl", "0"))
        self.ttl_ms = int(ttl * 1000) if ttl > 0 else None
        mode = config.option("cluster", "auto")
        if mode not in ("auto", "yes", "no"):
            raise ValueError("redis cluster= must be auto, yes or no")
        self.mode = mode
        self._client: Any = None
        self.clustered: bool | None = None
        self._lock = threading.Lock()
        self._pool: np.ndarray | None = None

    # -- connection ----------------------------------------------------------------------
    def _common(self) -> dict[str, Any]:
        c = self.config
        return {
            "socket_timeout": c.timeout_s,
            "socket_connect_timeout": c.timeout_s,
            "username": c.username,
            "password": c.password,
            "ssl": c.tls,
        }

    def _connect(self) -> Any:
        r = self._redis
        c = self.config
        cluster = self.mode == "yes" or (self.mode == "auto" and len(c.hosts) > 1)
        if not cluster and self.mode == "auto":
            probe = r.Redis(host=c.hosts[0][0], port=c.hosts[0][1], db=c.db, **self._common())
            try:
                cluster = bool(probe.info("cluster").get("cluster_enabled"))
            finally:
                probe.close()
        if cluster:
            from redis.backoff import NoBackoff
            from redis.cluster import ClusterNode, RedisCluster
            from redis.retry import Retry

            # One attempt per call: retrying an outage belongs to attach.py's degraded mode,
            # and a request thread must not spin through topology refreshes for seconds.
            return RedisCluster(
                startup_nodes=[ClusterNode(h, p) for h, p in c.hosts],
                retry=Retry(NoBackoff(), 0),
                **self._common(),
            )
        return r.Redis(host=c.hosts[0][0], port=c.hosts[0][1], db=c.db, **self._common())

    def client(self) -> Any:
        """The redis-py client, built on first use (TierError when the store is down)."""
        with self._lock:
            if self._client is None:
                try:
                    self._client = self._connect()
                except self._redis.RedisError as exc:
                    raise TierError(f"redis connect failed: {exc}") from exc
                self.clustered = type(self._client).__name__ == "RedisCluster"
            return self._client

    def _reset(self) -> None:
        """Drop the client after an error so the next call rebuilds the topology."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):  # closing a broken client is best effort
                client.close()

    def _run(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Execute ``(name, *args)`` commands in one pipeline; TierError on an outage."""
        if not commands:
            return []
        try:
            pipe = self.client().pipeline(transaction=False)
            for name, *args in commands:
                getattr(pipe, name)(*args)
            return list(pipe.execute(raise_on_error=True))
        except self._redis.RedisError as exc:
            self._reset()
            raise TierError(f"redis {commands[0][0]} failed: {type(exc).__name__}: {exc}") from exc

    def head_key(self, key: str) -> str:
        """The key holding ``key``'s header and first chunk (its hash tag names the slot)."""
        return f"{self.prefix}{{{key_digest(key).hex()}}}"

    @staticmethod
    def chunk_key(head: str, gen: int, index: int) -> str:
        """The key of chunk ``index`` of write ``gen`` of an entry."""
        return f"{head}:{gen:016x}:{index}"

    # -- interface -----------------------------------------------------------------------
    def attach_pool(self, pool: np.ndarray) -> None:
        self._pool = pool

    def put_batch(self, items: Sequence[PutItem]) -> list[bool]:
        assert self._pool is not None, "attach_pool first"
        pool = self._pool
        commands: list[tuple[Any, ...]] = []
        head_at: list[int] = []
        for item in items:
            nbytes = item.header.nbytes
            nchunks = max(1, -(-nbytes // self.chunk_bytes))
            gen = secrets.randbits(63) if nchunks > 1 else 0
            head_key = self.head_key(item.key)
            header = Header(
                item.header.dtype,
                item.header.shape,
                nbytes,
                item.header.crc32,
                item.header.digest,
                self.chunk_bytes if nchunks > 1 else 0,
                nchunks,
                gen,
            )
            chunks = _split(pool, item.runs, self.chunk_bytes)
            for i, chunk in enumerate(chunks[1:], start=1):
                commands.append(("set", self.chunk_key(head_key, gen, i), chunk, None, self.ttl_ms))
            head = header.pack() + (chunks[0] if chunks else b"")
            commands.append(("set", head_key, head, None, self.ttl_ms))
            head_at.append(len(commands) - 1)
        results = self._run(commands)
        return [bool(results[i]) for i in head_at]  # the head SET answers for its entry

    def get_batch(self, keys: Sequence[str], reserve: Reserve) -> list[FetchResult]:
        assert self._pool is not None, "attach_pool first"
        heads = [self.head_key(k) for k in keys]
        values = self._run([("get", h) for h in heads])
        out = [FetchResult.MISSING] * len(keys)
        parsed: list[tuple[int, Header, bytes]] = []
        more: list[tuple[Any, ...]] = []
        for i, (key, value) in enumerate(zip(keys, values, strict=True)):
            if value is None:
                continue
            header = Header.unpack(value)
            if header is None or header.digest != key_digest(key):
                out[i] = FetchResult.CORRUPT
                continue
            parsed.append((i, header, value))
            for c in range(1, header.nchunks):
                more.append(("get", self.chunk_key(heads[i], header.gen, c)))
        chunk_values = iter(self._run(more))
        for i, header, value in parsed:
            pieces = [memoryview(value)[HEADER_BYTES:]]
            pieces += [memoryview(next(chunk_values) or b"") for _ in range(1, header.nchunks)]
            if sum(p.nbytes for p in pieces) != header.nbytes:
                out[i] = FetchResult.CORRUPT  # a chunk evicted or cut short
                continue
            runs = reserve(keys[i], header)
            if runs is None:
                out[i] = FetchResult.SKIPPED
                continue
            scatter(self._pool, runs, pieces)
            out[i] = FetchResult.FILLED
        return out

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return [bool(n) for n in self._run([("exists", self.head_key(k)) for k in keys])]

    def delete(self, keys: Sequence[str], *, force: bool = False) -> int:
        heads = [self.head_key(k) for k in keys]
        raw = self._run([("getrange", h, 0, HEADER_BYTES - 1) for h in heads])
        commands: list[tuple[Any, ...]] = []
        for head, data in zip(heads, raw, strict=True):
            header = Header.unpack(data) if data else None
            if header is not None:
                for c in range(1, header.nchunks):
                    commands.append(("delete", self.chunk_key(head, header.gen, c)))
            commands.append(("delete", head))
        results = self._run(commands)
        head_set = set(heads)
        pairs = zip(commands, results, strict=True)
        return sum(1 for (_, key), n in pairs if key in head_set and n)

    def ping(self) -> None:
        client = self.client()
        try:
            if self.clustered:
                # Every primary must answer: a cluster with a failed slot range is down.
                state = client.cluster_info(target_nodes=client.get_random_node())
                if state.get("cluster_state") != "ok":
                    raise TierError(f"redis cluster state is {state.get('cluster_state')}")
                client.ping(target_nodes=client.PRIMARIES)
            else:
                client.ping()
        except self._redis.RedisError as exc:
            self._reset()
            raise TierError(f"redis ping failed: {type(exc).__name__}: {exc}") from exc

    def describe(self) -> dict[str, object]:
        return {
            "backend": "redis",
            "endpoints": self.config.redacted_url(),
            "cluster": self.clustered,
            "chunk_bytes": self.chunk_bytes,
            "ttl_s": self.ttl_ms / 1000 if self.ttl_ms else None,
        }

    def close(self) -> None:
        self._reset()


def _split(pool: np.ndarray, runs: Sequence[tuple[int, int]], chunk: int) -> list[bytes]:
    """The payload in the runs, as consecutive byte strings of ``chunk`` bytes (last shorter)."""
    out: list[bytes] = []
    parts: list[memoryview] = []
    filled = 0
    for off, length in runs:
        pos = 0
        while pos < length:
            take = min(chunk - filled, length - pos)
            parts.append(pool[off + pos : off + pos + take].data)
            filled += take
            pos += take
            if filled == chunk:
                out.append(b"".join(parts))
                parts, filled = [], 0
    if parts:
        out.append(b"".join(parts))
    return out
