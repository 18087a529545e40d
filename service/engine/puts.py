"""Puts of :class:`~embcache.service.engine.CacheEngine`: validate and reserve pages
(``begin_put``, evicting LRU entries when needed), then commit or abort the fill
(``fill.py``'s PutHandle calls back here)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from embcache.errors import (
    Draining,
    InvalidArgument,
    MetadataConflict,
    PoolExhausted,
    QuotaExceeded,
)
from embcache.proto.dtypes import from_torch
from embcache.service.engine.state import EngineState
from embcache.service.host import admission
from embcache.service.host.entries import Entry, EntryState
from embcache.service.host.put_writer import PutHandle
from embcache.service.host.stats import run_bucket

log = logging.getLogger("embcache.service.engine")


class PutOps(EngineState):
    def begin_put(
        self,
        key: str,
        dtype: str,
        shape: Sequence[int],
        *,
        nbytes: int | None = None,
        checksum: int | None = None,
        owner: str = "local",
        copy_in: Callable[[tuple[tuple[int, int], ...]], None] | None = None,
        pages: tuple[tuple[int, int], ...] | None = None,
    ) -> PutHandle:
        """Validate, then reserve pages for a new entry (evicting LRU entries if needed).

        ``copy_in(byte_runs)``, for a copy that needs no handle (a put from a device): called
        as soon as the pages are reserved, before the entry is recorded, to queue the copy of
        every byte into ``byte_runs`` (in order); the handle then counts them as written, and
        the caller calls ``filled()`` once the copy is complete. Not called when the key
        exists already. If it raises, the pages go back at once: it must not leave a copy
        into them running.

        ``pages``: page runs the caller took from the put landing and queued the whole copy
        into already (:meth:`landing_copy`); the entry adopts them, and the handle counts
        every byte as written. Nothing adopts them when this raises or the key exists
        already: the caller gives them back (:meth:`return_landing`) once the copy is done."""
        key = admission.check_key(key, self.settings)
        meta = admission.check_meta(dtype, shape, nbytes, self.settings)
        crc = admission.check_checksum(checksum)
        npages = -(-meta.nbytes // self.settings.page_bytes)
        with self._lock:
            self._check_open()
            existing = self._entries.get(key)
            if existing is not None:
                self._check_same_meta(existing, meta.dtype, meta.shape)
                self._entries.touch(existing)
                return PutHandle(None, 0, existing, (), crc)
            if self._inflight[owner] + meta.nbytes > self.settings.inflight_limit:
                raise QuotaExceeded(
                    "too many bytes in unfinished puts",
                    owner=owner,
                    inflight=self._inflight[owner],
                    nbytes=meta.nbytes,
                    limit=self.settings.inflight_limit,
                )
            if pages is None:
                runs = self._reserve(npages, meta.nbytes)
            else:
                assert sum(n for _, n in pages) == npages, (pages, npages)
                runs = list(pages)
            byte_runs = tuple(self.host_pool.byte_runs(runs, meta.nbytes))
            if copy_in is not None:
                try:
                    copy_in(byte_runs)
                except BaseException:
                    self._alloc.free(runs)
                    raise
            entry = Entry(
                key,
                meta.dtype,
                meta.shape,
                meta.nbytes,
                tuple(runs),
                EntryState.FILLING,
                crc,
                0,
                self._clock(),
            )
            put_id = next(self._put_ids)
            self._filling[put_id] = (entry, owner)
            self._inflight[owner] += meta.nbytes
        written = meta.nbytes if copy_in is not None or pages is not None else 0
        return PutHandle(self, put_id, entry, byte_runs, crc, written)

    def put(self, key: str, tensor: torch.Tensor, *, owner: str = "local") -> bool:
        """Store a CPU tensor in one call. True if created, False if it already existed."""
        dt = from_torch(tensor.dtype)
        if dt is None:
            raise InvalidArgument("unsupported dtype", dtype=str(tensor.dtype))
        handle = self.begin_put(key, dt.name, tuple(tensor.shape), owner=owner)
        with handle:
            handle.write(tensor.detach().cpu().contiguous())
            return handle.commit()

    # -- the put landing (put_landing.py) ------------------------------------------------
    def landing_copy(
        self,
        key: str,
        nbytes: int,
        copy_in: Callable[[tuple[tuple[int, int], ...]], None],
    ) -> tuple[tuple[int, int], ...] | None:
        """Take pages for a put of ``nbytes`` from the put landing and queue the copy into
        them at once (``copy_in(byte_runs)``, as for :meth:`begin_put`), before the put is
        checked; then :meth:`begin_put` with ``pages=``. None, with nothing copied, when
        the landing has too few pages, the key is stored already (an idempotent put copies
        nothing) or the engine is closed. Under the engine lock, so ``close`` never unmaps
        the pool under a copy it has not seen queued."""
        with self._lock:
            if self._closed or key in self._entries.by_key:
                return None
            pages = self._landing.take(-(-nbytes // self.settings.page_bytes))
            if pages is None:
                return None
            try:
                copy_in(tuple(self.host_pool.byte_runs(pages, nbytes)))
            except BaseException:
                self._landing.give_back(pages)  # copy_in left no copy running
                raise
            return pages

    def return_landing(self, pages: tuple[tuple[int, int], ...]) -> None:
        """Pages from :meth:`landing_copy` that no entry adopted (their copy complete)."""
        self._landing.give_back(pages)

    def top_up_landing(self) -> None:
        """Refill the put landing to what the last puts asked for, evicting LRU entries as
        a put would; nothing when the pool has no room to spare. Runs while a put's copy
        does, so the next put from a device finds its pages ready."""
        with self._lock:
            n = self._landing.shortfall()
            if n and not self._closed and (runs := self._take_pages(n)) is not None:
                self._landing.add(runs)

    def _reserve(self, npages: int, nbytes: int) -> list[tuple[int, int]]:
        if self._alloc.num_free_pages < npages and self._landing.pages:
            self._alloc.free(self._landing.drain())  # free capacity on loan: room first
        runs = self._take_pages(npages)
        if runs is None:
            raise PoolExhausted(
                "no room: the pool is full of leased or filling entries",
                nbytes=nbytes,
                free_pages=self._alloc.num_free_pages,
                evictable_pages=self._entries.evictable_pages,
            )
        return runs

    def _take_pages(self, npages: int) -> list[tuple[int, int]] | None:
        """``npages`` pages from the allocator, evicting LRU entries until they are free;
        None (nothing evicted) when even evicting every unleased entry would not do."""
        if self._alloc.num_free_pages + self._entries.evictable_pages < npages:
            return None
        while self._alloc.num_free_pages < npages:
            victim = self._entries.lru_oldest()
            assert victim is not None, "evictable page count out of step with the LRU"
            self._evict_locked(victim)
        runs = self._alloc.allocate(npages)
        assert runs is not None, "allocation failed with enough free pages"
        return runs

    def _commit_fill(self, put_id: int) -> bool:
        with self._lock:
            if put_id not in self._filling:
                raise Draining("engine closed before the put committed")
            entry, owner = self._end_fill(put_id)
            existing = self._entries.get(entry.key)
            if existing is not None:  # a concurrent put of the same key committed first
                self._alloc.free(entry.runs)
                self._check_same_meta(existing, entry.dtype, entry.shape)
                return False
            entry.state = EntryState.READY
            entry.last_access = self._clock()
            self._entries.add_ready(entry)
            self._runs_hist[run_bucket(len(entry.runs))] += 1
            self._counters["puts_committed"] += 1
            self._counters["put_bytes"] += entry.nbytes
        self.device_tier.prepare(entry)
        for listener in self.commit_listeners:
            try:
                listener(entry.key, owner)
            except Exception:  # a listener (e.g. write-through) never fails the put
                log.exception("commit listener failed for %r", entry.key)
        return True

    def _abort_fill(self, put_id: int) -> None:
        with self._lock:
            if put_id not in self._filling:
                return  # already dropped by close()
            entry, _ = self._end_fill(put_id)
            self._alloc.free(entry.runs)
            entry.state = EntryState.FREED
            self._counters["puts_aborted"] += 1

    def _end_fill(self, put_id: int) -> tuple[Entry, str]:
        entry, owner = self._filling.pop(put_id)
        self._inflight[owner] -= entry.nbytes
        if not self._inflight[owner]:
            del self._inflight[owner]
        return entry, owner

    @staticmethod
    def _check_same_meta(existing: Entry, dtype: Any, shape: tuple[int, ...]) -> None:
        if not existing.same_meta(dtype, shape):
            raise MetadataConflict(
                "key exists with different metadata",
                key=existing.key,
                existing_dtype=existing.dtype.name,
                existing_shape=list(existing.shape),
                dtype=dtype.name,
                shape=list(shape),
            )
