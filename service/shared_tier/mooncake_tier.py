"""Mooncake Store adapter (its Python package, TCP transport, a master address).

Objects are ``<prefix><digest>`` = 256-byte header + payload. The whole host pool is
registered with the store's transfer engine once, so both directions move payload bytes
straight between the store and the entry's page runs, with no intermediate copy:

- put: ``batch_put_from_multi_buffers`` gathers [header slot, run 1, run 2, ...];
- get: ``get_into_ranges`` reads every key's header into a registered header arena (one
  call), the engine reserves pages from those headers, then a second ``get_into_ranges``
  scatters each payload into its page runs (one call for the whole batch). Two round trips
  because pages cannot be reserved before the header says how many.

Limits of this adapter (docs/scale-out.md): the transfer engine's TCP listeners bind every
interface (no bind option in the package's TCP transport) and its data port accepts raw
memory reads/writes without authentication, so the store must live on a trusted, isolated
network; objects are lost when the master restarts unless it runs with HA/snapshots.
"""

from __future__ import annotations

import socket
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
    object_name,
)
from embcache.service.tier_config import SharedTierConfig

OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
ARENA_SLOTS = 1024


def local_address(master: tuple[str, int]) -> str:
    """The address of the interface that routes to the master (a UDP connect sends nothing)."""
    host = master[0]
    if host in ("localhost", "::1") or host.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(master)
        return str(s.getsockname()[0])


class _HeaderArena:
    """Registered memory for headers: slots of HEADER_BYTES handed out under a condition."""

    def __init__(self, slots: int) -> None:
        self.buf = np.zeros(slots * HEADER_BYTES, dtype=np.uint8)
        self.ptr = int(self.buf.ctypes.data)
        self._free = list(range(slots))
        self._cond = threading.Condition()

    def acquire(self, n: int) -> list[int]:
        with self._cond:
            self._cond.wait_for(lambda: len(self._free) >= n)
            taken, self._free = self._free[:n], self._free[n:]
            return taken

    def release(self, slots: list[int]) -> None:
        with self._cond:
            self._free.extend(slots)
            self._cond.notify_all()

    def view(self, slot: int) -> np.ndarray:
        return self.buf[slot * HEADER_BYTES : (slot + 1) * HEADER_BYTES]


class MooncakeTier(SharedTierBackend):
    """The store through ``MooncakeDistributedStore`` (module docstring); set up against the
    master on construction (TierError when that fails)."""

    name = "mooncake"

    def __init__(self, config: SharedTierConfig) -> None:
        from mooncake.store import MooncakeDistributedStore  # optional dependency

        self.config = config
        self.prefix = config.option("prefix", "embcache/")
        self.master = f"{config.hosts[0][0]}:{config.hosts[0][1]}"
        self.segment_bytes = config.size_option("segment", 0)
        self.buffer_bytes = config.size_option("buffer", 16 * 1024 * 1024)
        self.protocol = config.option("protocol", "tcp")
        self.metadata = config.option("metadata", "P2PHANDSHAKE")
        self.device = config.option("device", "")
        self.host = config.option("host", "") or local_address(config.hosts[0])
        self._store = MooncakeDistributedStore()
        rc = self._store.setup(
            self.host,
            self.metadata,
            self.segment_bytes,
            self.buffer_bytes,
            self.protocol,
            self.device,
            self.master,
        )
        if rc != 0:
            raise TierError(f"mooncake setup against master {self.master} failed: {rc}")
        self._arena = _HeaderArena(ARENA_SLOTS)
        self._register(self._arena.ptr, self._arena.buf.nbytes)
        self._pool: np.ndarray | None = None
        self._pool_ptr = 0
        self._closed = False

    def _register(self, ptr: int, nbytes: int) -> None:
        rc = self._store.register_buffer(ptr, nbytes)
        if rc != 0:
            raise TierError(f"mooncake register_buffer failed: {rc}")

    def attach_pool(self, pool: np.ndarray) -> None:
        self._pool = pool
        self._pool_ptr = int(pool.ctypes.data)
        self._register(self._pool_ptr, pool.nbytes)

    def _names(self, keys: Sequence[str]) -> list[str]:
        return [object_name(self.prefix, k) for k in keys]

    # -- interface -----------------------------------------------------------------------
    def put_batch(self, items: Sequence[PutItem]) -> list[bool]:
        out: list[bool] = []
        step = ARENA_SLOTS // 2
        for start in range(0, len(items), step):
            out += self._put_some(items[start : start + step])
        return out

    def _put_some(self, items: Sequence[PutItem]) -> list[bool]:
        slots = self._arena.acquire(len(items))
        try:
            ptrs: list[list[int]] = []
            sizes: list[list[int]] = []
            for slot, item in zip(slots, items, strict=True):
                self._arena.view(slot)[:] = np.frombuffer(item.header.pack(), dtype=np.uint8)
                ptrs.append(
                    [self._arena.ptr + slot * HEADER_BYTES]
                    + [self._pool_ptr + off for off, _ in item.runs]
                )
                sizes.append([HEADER_BYTES] + [length for _, length in item.runs])
            codes = self._store.batch_put_from_multi_buffers(
                self._names([i.key for i in items]), ptrs, sizes
            )
        finally:
            self._arena.release(slots)
        ok = [c == 0 or c == OBJECT_ALREADY_EXISTS for c in codes]
        if items and not any(ok):
            raise TierError(f"mooncake put failed: codes {sorted(set(codes))}")
        return ok

    def get_batch(self, keys: Sequence[str], reserve: Reserve) -> list[FetchResult]:
        out: list[FetchResult] = []
        step = ARENA_SLOTS // 2
        for start in range(0, len(keys), step):
            out += self._get_some(keys[start : start + step], reserve)
        return out

    def _get_some(self, keys: Sequence[str], reserve: Reserve) -> list[FetchResult]:
        assert self._pool is not None, "attach_pool first"
        names = self._names(keys)
        out = [FetchResult.MISSING] * len(keys)
        slots = self._arena.acquire(len(keys))
        try:
            got = self._store.get_into_ranges(
                [self._arena.ptr],
                [names],
                [[[s * HEADER_BYTES] for s in slots]],
                [[[0] for _ in keys]],
                [[[HEADER_BYTES] for _ in keys]],
            )[0]
            headers: list[Header | None] = []
            for i, slot in enumerate(slots):
                n = got[i][0]
                if n == OBJECT_NOT_FOUND:
                    headers.append(None)
                    continue
                if n < 0:
                    raise TierError(f"mooncake get failed: code {n}")
                h = Header.unpack(self._arena.view(slot)) if n == HEADER_BYTES else None
                if h is None or h.digest.hex() != names[i][len(self.prefix) :]:
                    out[i] = FetchResult.CORRUPT
                headers.append(h if out[i] is FetchResult.MISSING else None)
        finally:
            self._arena.release(slots)
        want: list[int] = []
        dst: list[list[int]] = []
        src: list[list[int]] = []
        sizes: list[list[int]] = []
        for i, header in enumerate(headers):
            if header is None:
                continue
            runs = reserve(keys[i], header)
            if runs is None:
                out[i] = FetchResult.SKIPPED
                continue
            want.append(i)
            dst.append([off for off, _ in runs])
            sizes.append([length for _, length in runs])
            pos, offsets = HEADER_BYTES, []
            for _, length in runs:
                offsets.append(pos)
                pos += length
            src.append(offsets)
        if not want:
            return out
        got = self._store.get_into_ranges(
            [self._pool_ptr], [[names[i] for i in want]], [dst], [src], [sizes]
        )[0]
        for j, i in enumerate(want):
            ok = all(n == size for n, size in zip(got[j], sizes[j], strict=True))
            out[i] = FetchResult.FILLED if ok else FetchResult.CORRUPT
        return out

    def exists(self, keys: Sequence[str]) -> list[bool]:
        codes = self._store.batch_is_exist(self._names(keys))
        if keys and all(c < 0 for c in codes):
            raise TierError("mooncake exists failed")
        return [c == 1 for c in codes]

    def delete(self, keys: Sequence[str], *, force: bool = False) -> int:
        codes = self._store.batch_remove(self._names(keys), force)
        return sum(1 for c in codes if c == 0)

    def ping(self) -> None:
        # health_check() answers from a cache while the master is gone; an exists query
        # makes a real round trip to the master.
        codes = self._store.batch_is_exist([self.prefix + "ping"])
        if not codes or codes[0] < 0:
            raise TierError(f"mooncake master {self.master} unreachable")

    def describe(self) -> dict[str, object]:
        return {
            "backend": "mooncake",
            "endpoints": self.config.redacted_url(),
            "protocol": self.protocol,
            "segment_bytes": self.segment_bytes,
            "local_address": self.host,
        }

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        store: Any = self._store
        if self._pool is not None:
            store.unregister_buffer(self._pool_ptr)
        store.unregister_buffer(self._arena.ptr)
        store.close()
