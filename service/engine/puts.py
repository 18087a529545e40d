"""The bookkeeping of a put, on the host store, with the engine's lock held.

A put is validated before any page is reserved (``host/admission.py``). Its FILLING
reservation lives outside the key map, so no reader can see it. Two puts of one key may
both fill; the first commit wins and the second gives its pages back. A put of a key that
is READY with the same metadata gets a handle that checks and drops its bytes.

Puts from a device (``device_puts.py``) queue their copy as early as they can, in one of
two ways. With pages from the prealloc (:func:`prealloc_copy`): the copy is queued before
the put is checked, then ``CacheEngine.begin_put(..., pages=)`` lets the entry adopt them.
Otherwise :func:`reserve` calls ``copy_in(byte_runs)`` the moment pages are reserved,
before the entry is recorded. Both run under the engine's lock, so ``copy_in`` must not
call the engine, and ``CacheEngine.close`` never unmaps the pool under a copy it has not
seen queued (a closed engine hands out no prealloc pages).
"""

from __future__ import annotations

from collections.abc import Callable

from embcache.errors import Draining, MetadataConflict, PoolExhausted, QuotaExceeded
from embcache.proto.dtypes import DType
from embcache.service.host.admission import EntryMeta
from embcache.service.host.entries import Entry, EntryState
from embcache.service.host.quarantine import ProcessRef
from embcache.service.host.store import HostStore

Runs = tuple[tuple[int, int], ...]
CopyIn = Callable[[Runs], None]


def reserve(
    store: HostStore,
    key: str,
    meta: EntryMeta,
    crc: int | None,
    owner: str,
    *,
    quota: int,
    now: float,
    copy_in: CopyIn | None,
    pages: Runs | None,
    writer: tuple[ProcessRef, int] | None = None,
) -> Entry | tuple[Entry, int, Runs]:
    """Reserve pages for a new entry (evicting LRU entries if need be) and record it as
    FILLING: ``(entry, put id, byte runs)``; or the READY entry of that key, when its
    metadata matches (MetadataConflict when it does not).

    ``copy_in(byte_runs)`` queues the copy of every byte as soon as the pages are reserved,
    before the entry is recorded (if it raises, the pages go back at once). ``pages``: runs
    from the prealloc that are being copied into already; the entry adopts them.
    ``writer``: the client process that fills the pages itself, through its own mapping,
    and the id it knows the reservation by (``host/store_writes.py``: the pages stay out of
    reuse until it is done or gone).

    Raises QuotaExceeded (``owner`` has more than ``quota`` bytes in open puts) and
    PoolExhausted (no room, or ``max_entries`` reached, even after evicting every unleased
    entry), reserving nothing."""
    existing = store.lookup(key)  # an adopted entry whose bytes fail their CRC is replaced
    if existing is not None:
        check_same_meta(existing, meta.dtype, meta.shape)
        store.entries.touch(existing)
        return existing
    left = store.quota_left(owner, quota)
    if meta.nbytes > left:
        raise QuotaExceeded(
            "too many bytes in unfinished puts",
            owner=owner,
            inflight=quota - left,
            nbytes=meta.nbytes,
            limit=quota,
        )
    if not store.entry_room():  # max_entries: evicts LRU entries, zero-byte ones too
        raise PoolExhausted(
            "no room for another entry: every entry is leased or filling",
            max_entries=store.max_entries,
        )
    npages = store.pages_for(meta.nbytes)
    if pages is None:
        runs = store.reserve(npages)
        if runs is None:
            raise PoolExhausted(
                "no room: the pool is full of leased or filling entries",
                nbytes=meta.nbytes,
                free_pages=store.alloc.num_free_pages,
                evictable_pages=store.entries.evictable_pages,
            )
    else:
        assert sum(n for _, n in pages) == npages, (pages, npages)
        runs = list(pages)
    byte_runs = store.byte_runs(runs, meta.nbytes)
    if copy_in is not None:
        try:
            copy_in(byte_runs)
        except BaseException:
            store.alloc.free(runs)
            raise
    state = EntryState.FILLING
    entry = Entry(key, meta.dtype, meta.shape, meta.nbytes, tuple(runs), state, crc, 0, now)
    put_id = store.open_fill(entry, owner)
    if writer is not None:
        store.open_writer(put_id, *writer, entry)
    return entry, put_id, byte_runs


def commit(store: HostStore, put_id: int, now: float) -> tuple[Entry, str] | None:
    """Make a filled reservation READY: its entry and owner, or None when a concurrent put
    of the same key committed first (this one's pages go back). Draining if the engine
    closed meanwhile (the reservation is gone)."""
    found = store.close_fill(put_id)
    if found is None:
        raise Draining("engine closed before the put committed")
    entry, owner = found
    store.close_writer(put_id, entry, owner, stopped=True)  # its writer finished: it commits
    existing = store.entries.get(entry.key)
    if existing is not None:
        store.alloc.free(entry.runs)
        check_same_meta(existing, entry.dtype, entry.shape)
        return None
    store.add_ready(entry, now)
    return entry, owner


def abort(store: HostStore, put_id: int, *, writer_stopped: bool = True) -> None:
    """End a reservation; nothing of it becomes visible. Its pages go back, unless a client
    fills them itself and may still be writing (``writer_stopped`` False and its process
    runs): then they are held until it has exited (``host/store_writes.py``)."""
    found = store.close_fill(put_id)
    if found is None:
        return  # already dropped by close()
    entry, owner = found
    if not store.close_writer(put_id, entry, owner, stopped=writer_stopped):
        store.discard(entry)
    store.counters["puts_aborted"] += 1


def prealloc_copy(store: HostStore, key: str, nbytes: int, copy_in: CopyIn) -> Runs | None:
    """Pages from the prealloc for a put of ``nbytes``, with its copy queued into them
    (``copy_in(byte_runs)``); None, with nothing copied, when the prealloc has too few or
    the key is stored already (an idempotent put copies nothing)."""
    if key in store.entries.by_key:
        return None
    pages = store.prealloc.take(store.pages_for(nbytes))
    if pages is None:
        return None
    try:
        copy_in(store.byte_runs(pages, nbytes))
    except BaseException:
        store.prealloc.give_back(pages)  # copy_in left no copy running
        raise
    return pages


def check_same_meta(existing: Entry, dtype: DType, shape: tuple[int, ...]) -> None:
    """The collision guard: MetadataConflict unless ``existing`` has this dtype and shape."""
    if not existing.same_meta(dtype, shape):
        raise MetadataConflict(
            "key exists with different metadata",
            key=existing.key,
            existing_dtype=existing.dtype.name,
            existing_shape=list(existing.shape),
            dtype=dtype.name,
            shape=list(shape),
        )
