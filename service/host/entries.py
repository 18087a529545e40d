"""Entries and the LRU of evictable ones.

An entry is READY in ``EntryTable.by_key``; FILLING entries live only in the host store's
reservation map (``HostStore.open_fill``), so no reader can see them. The LRU holds exactly
the READY entries with no lease: taking the first lease removes an entry from it, dropping
the last puts it back at the most-recently-used end. Eviction therefore never has to skip
leased entries.

The table also sums an estimate of the memory its entries' metadata takes
(:func:`meta_bytes`), for the stats: the number of entries is bounded, not their bytes, so
zero-byte entries (which take no page) still cost something.
"""

from __future__ import annotations

import enum
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from embcache.proto.dtypes import DType

if TYPE_CHECKING:
    import numpy as np


class EntryState(enum.IntEnum):
    """FILLING (reserved, invisible), READY (in the key map), FREED (its pages went back),
    DROPPED (out of the key map, its pages kept until the holds on them end)."""

    FILLING = 1
    READY = 2
    FREED = 3
    DROPPED = 4


@dataclass(slots=True, eq=False)
class Entry:
    """One cached tensor: its metadata, its host page runs and its lease count.

    Compared by identity (``eq=False``): device pools key their residencies by the entry
    object, so a new entry of the same key never inherits an evicted one's copies."""

    key: str
    dtype: DType
    shape: tuple[int, ...]
    nbytes: int
    runs: tuple[tuple[int, int], ...]  # page runs (first page, number of pages)
    state: EntryState
    checksum: int | None = None
    ref_cnt: int = 0
    last_access: float = 0.0
    num_pages: int = field(init=False)  # sum of the runs' lengths (runs never change)
    host_cols: np.ndarray | None = field(default=None, repr=False)  # copy_plan.entry_columns
    crc32: int | None = None  # of the bytes, for the warm-restart index (pool_index.py)
    unverified: bool = False  # adopted at a warm restart; its crc32 not checked yet

    def __post_init__(self) -> None:
        self.num_pages = sum(n for _, n in self.runs)

    def same_meta(self, dtype: DType, shape: tuple[int, ...]) -> bool:
        """Whether a put of this dtype and shape is the same entry (the collision guard)."""
        return self.dtype is dtype and self.shape == shape


# The key map's and the LRU's slots for one entry: a dict slot and an OrderedDict node,
# measured with tracemalloc on CPython 3.11 at about 40 and 90 bytes.
TABLE_SLOT_BYTES = 130


def meta_bytes(entry: Entry) -> int:
    """An estimate of the memory one READY entry's metadata takes: the Entry, its key, shape
    and runs (``sys.getsizeof``) plus its slots in the tables (``TABLE_SLOT_BYTES``)."""
    size = sys.getsizeof
    return size(entry) + size(entry.key) + size(entry.shape) + size(entry.runs) + TABLE_SLOT_BYTES


class EntryTable:
    """The READY entries by key, and the LRU of those without a lease (module docstring)."""

    def __init__(self) -> None:
        self.by_key: dict[str, Entry] = {}
        self._lru: OrderedDict[str, Entry] = OrderedDict()
        self.evictable_pages = 0
        self.meta_bytes = 0  # sum of meta_bytes() over the READY entries

    def __len__(self) -> int:
        return len(self.by_key)

    def get(self, key: str) -> Entry | None:
        return self.by_key.get(key)

    def add_ready(self, entry: Entry) -> None:
        """A committed entry becomes visible, at the most-recently-used end of the LRU."""
        assert entry.state is EntryState.READY and entry.key not in self.by_key, entry.key
        self.by_key[entry.key] = entry
        self.meta_bytes += meta_bytes(entry)
        self._lru_push(entry)

    def remove(self, entry: Entry) -> None:
        """Forget an unleased entry (evicted or freed)."""
        assert entry.ref_cnt == 0, f"removing leased entry {entry.key!r}"
        del self.by_key[entry.key]
        self.meta_bytes -= meta_bytes(entry)
        if self._lru.pop(entry.key, None) is not None:
            self.evictable_pages -= entry.num_pages
        entry.state = EntryState.FREED

    def forget(self, entry: Entry) -> None:
        """Take a held (leased) entry out of the key map: it is never served again, and
        its pages stay until the last hold ends (state DROPPED)."""
        assert entry.ref_cnt > 0 and entry.key not in self._lru, entry.key
        del self.by_key[entry.key]
        self.meta_bytes -= meta_bytes(entry)
        entry.state = EntryState.DROPPED

    def touch(self, entry: Entry) -> None:
        """Mark an unleased entry as just used (a repeated identical put)."""
        if entry.key in self._lru:
            self._lru.move_to_end(entry.key)

    def acquire(self, entry: Entry) -> None:
        """Take a reference; the first one takes the entry out of the LRU (not evictable)."""
        entry.ref_cnt += 1
        if entry.ref_cnt == 1:
            self._lru.pop(entry.key)
            self.evictable_pages -= entry.num_pages

    def release(self, entry: Entry) -> None:
        """Drop a reference; the last one puts a READY entry back in the LRU."""
        assert entry.ref_cnt > 0, f"release of unleased entry {entry.key!r}"
        entry.ref_cnt -= 1
        if entry.ref_cnt == 0 and entry.state is EntryState.READY:
            self._lru_push(entry)

    def _lru_push(self, entry: Entry) -> None:
        self._lru[entry.key] = entry
        self.evictable_pages += entry.num_pages

    @property
    def evictable_count(self) -> int:
        """How many entries have no lease (and may be evicted)."""
        return len(self._lru)

    def lru_oldest(self) -> Entry | None:
        """The least recently used unleased entry, or None when every entry is leased."""
        if not self._lru:
            return None
        return next(iter(self._lru.values()))
