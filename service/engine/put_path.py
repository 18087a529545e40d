"""The put path: validate a put, reserve its pages, hand out the handle that fills them,
and commit or abort it.

Owned by :class:`~embcache.service.engine.engine.CacheEngine`, which calls it for puts of
bytes, and handed to ``DeviceSide`` for puts from device memory (``device_puts.py``). It
works on the engine's host store and device tier under the engine's gate (``gate.py``)
and holds no reference to the engine: the handle it returns calls back into this object
only (commit, abort, whether the engine closed).

A put is validated before any page is reserved (``host/admission.py``). Its FILLING
reservation is invisible to readers. Two puts of one key may both fill; the first commit
wins and the second gives its pages back. A put of a key that is READY with the same
metadata gets a handle that checks and drops its bytes. Puts from a device queue their
copy as early as they can: into pages from the prealloc before the put is checked
(:meth:`PutPath.take_prealloc`, then :meth:`PutPath.begin` with ``pages=``), else the
moment pages are reserved (``copy_in``). Both run under the gate, so ``copy_in`` must not
call the engine, and a closed engine hands out no prealloc pages (it never unmaps the pool
under a copy it has not seen queued).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from embcache.service.config import Settings
from embcache.service.device.tier import DeviceTier
from embcache.service.engine.gate import Gate
from embcache.service.host import admission
from embcache.service.host.entries import Entry
from embcache.service.host.put_writer import FillTarget, PutHandle
from embcache.service.host.store import CopyIn, HostStore, Runs
from embcache.service.host.verify import entry_crc

OnCommit = Callable[[str, str], None]  # (key, owner) of a new entry: the shared tier's


class PutPath:
    """Puts into the host store (module docstring)."""

    def __init__(
        self,
        settings: Settings,
        store: HostStore,
        tier: DeviceTier,
        gate: Gate,
        on_commit: OnCommit,
    ) -> None:
        self._settings = settings
        self._store = store
        self._tier = tier
        self._gate = gate
        self._on_commit = on_commit  # told of each new entry, outside the gate

    def begin(
        self,
        key: str,
        dtype: str,
        shape: Sequence[int],
        *,
        nbytes: int | None = None,
        checksum: int | None = None,
        owner: str = "local",
        copy_in: CopyIn | None = None,
        pages: Runs | None = None,
    ) -> PutHandle:
        """Validate a put, then reserve pages for it (evicting LRU entries if need be).

        Args:
            key, dtype, shape: the entry; ``nbytes`` and ``checksum`` (CRC32) are checked.
            owner: whose in-flight quota it counts against.
            copy_in, pages: see ``HostStore.reserve_put``.
        Returns:
            The handle that fills, commits or aborts the reservation (for a key that exists
            with the same metadata, one that only checks the bytes).
        Raises:
            InvalidArgument, EntryTooLarge, MetadataConflict, QuotaExceeded, PoolExhausted.
        """
        key = admission.check_key(key, self._settings)
        meta = admission.check_meta(dtype, shape, nbytes, self._settings)
        crc = admission.check_checksum(checksum)
        quota = self._settings.inflight_limit
        with self._gate:
            self._gate.check_open()
            found = self._store.reserve_put(
                key, meta, crc, owner,
                quota=quota, now=self._gate.clock(), copy_in=copy_in, pages=pages,
            )  # fmt: skip
        if isinstance(found, Entry):
            return PutHandle(None, found, (), crc)
        entry, put_id, byte_runs = found
        gate = self._gate
        target = FillTarget(
            self._store.pool.array,
            lambda: self._commit(put_id, entry),
            lambda: self._abort(put_id),
            lambda: gate.closed,
        )
        written = meta.nbytes if copy_in is not None or pages is not None else 0
        return PutHandle(target, entry, byte_runs, crc, written)

    def _commit(self, put_id: int, entry: Entry) -> bool:
        if self._settings.warm_restart and entry.crc32 is None:  # for the index; no lock held
            # its one writer is done with the bytes: nothing changes them meanwhile
            entry.crc32 = entry.checksum if entry.checksum is not None else self._crc(entry)
        with self._gate:
            done = self._store.commit_put(put_id, self._gate.clock())
        if done is None:
            return False
        entry, owner = done
        self._tier.prepare(entry)
        self._on_commit(entry.key, owner)
        return True

    def _crc(self, entry: Entry) -> int:
        return entry_crc(self._store.pool, entry)

    def _abort(self, put_id: int) -> None:
        with self._gate:
            self._store.abort_put(put_id)

    # -- the prealloc, for puts from a device (device_puts.py) ----------------------------
    def take_prealloc(self, key: str, nbytes: int, copy_in: CopyIn) -> Runs | None:
        """The prealloc's pages for a put of ``nbytes`` with ``copy_in(byte_runs)`` queued
        into them, for :meth:`begin` with ``pages=``; None, nothing copied, when it has too
        few, the key exists, or the engine closed."""
        with self._gate:
            if self._gate.closed:
                return None
            return self._store.take_prealloc(key, nbytes, copy_in)

    def give_back_prealloc(self, pages: Runs) -> None:
        """Pages from :meth:`take_prealloc` that no entry adopted (their copy complete)."""
        with self._gate:
            self._store.give_back_prealloc(pages)

    def top_up_prealloc(self) -> None:
        """Refill the prealloc (evicting as a put would) while a put's copy runs."""
        with self._gate:
            if not self._gate.closed:
                self._store.top_up_prealloc()
