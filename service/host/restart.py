"""Warm restart: adopt the READY entries a previous daemon left in its segment.

:class:`WarmStart` is made before the host pool: its :meth:`WarmStart.keep` tells the pool
whether a stale segment may be adopted (the index beside it has this layout version, page
size, number of pages and the segment's inode) or must be replaced, and why. Once the host
pool exists, :meth:`WarmStart.attach` decides what to adopt of what the index holds and
opens a fresh index (its generation bumped; a torn tail dropped): an ``Adoption`` the host
store is built from (``HostStore.adopting``).

Adoption trusts nothing it cannot check. An index this uid does not own, or that others may
write, is not read at all (``shm_files.py``: the start is cold, logged and counted). A
record a put would refuse (``admission.py``'s checks of the key, dtype, shape and size, run
as for a put) or that cannot be decoded is dropped, counted and logged, and the replay goes
on with the next one; a record whose runs leave the pool or overlap an earlier record's is
dropped; every adopted entry is checked against its CRC32 before it is first served
(``HostStore.lookup``) and by :class:`Verifier`, a background pass at ISA-L speed. Leases
do not survive, but a hold of a process that still runs (it may read the pages through
views) keeps its entry's pages out of reuse until that process exits (``quarantine.py``;
the daemon's reaper frees them); so do the pages a client process that still runs may be
writing through its own mapping (a reservation of the dead daemon: ``write_holds.py``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from embcache.errors import EmbCacheError
from embcache.service.config import Settings
from embcache.service.host import admission
from embcache.service.host import index_records as rec
from embcache.service.host.adoption import Adopted, Adoption
from embcache.service.host.entries import Entry, EntryState
from embcache.service.host.host_pool import INDEX_SUFFIXES, HostPool, unheld_segment
from embcache.service.host.pool_index import PoolIndex, Replayed, index_path, replay
from embcache.service.host.quarantine import Held, ProcessRef
from embcache.service.host.shm_files import UntrustedFile
from embcache.service.host.write_holds import Written
from embcache.service.text import plural

log = logging.getLogger(__name__)

_LOGGED = 8  # dropped records logged one by one at a start (then one line for the rest)


class WarmStart:
    """One start's warm-restart decisions (module docstring), for a pool of ``nbytes`` in
    pages of ``page_bytes``."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.nbytes = settings.host_pool_bytes
        self.page_bytes = settings.page_bytes
        self.replayed: Replayed | None = None
        self.untrusted = 0  # indexes refused: not this uid's, or writable by others
        self.reason: str | None = None  # why the segment was replaced, if it was
        self._dropped = (0, 0)  # entries, bytes of a replaced segment's index (if readable)

    def keep(self, segment: Path) -> Callable[[os.stat_result], str | None]:
        """The pool's ``keep``: None to adopt the stale segment at ``segment``, else why not."""

        def check(st: os.stat_result) -> str | None:
            self.reason = self._check(index_path(segment), st)
            if self.reason is not None:
                self.replayed = None
            return self.reason

        return check

    def _check(self, path: Path, st: os.stat_result) -> str | None:
        try:
            found = replay(path)
        except FileNotFoundError:
            return "no warm-restart index beside it (a daemon with --warm-restart off?)"
        except UntrustedFile as exc:  # never read: another user could have written it
            self.untrusted += 1
            log.error("warm restart: refusing the index beside %s: %s", path.name, exc)
            return f"its index is not this daemon's own ({exc})"
        except (OSError, rec.IndexFormatError) as exc:
            return f"its index is unreadable ({exc})"
        h = found.header
        if h.version != rec.LAYOUT_VERSION:
            return f"index layout version {h.version}, this daemon reads {rec.LAYOUT_VERSION}"
        self._dropped = (len(found.adds), sum(a.nbytes for a in found.adds.values()))
        if h.page_bytes != self.page_bytes:
            return f"page size {h.page_bytes}, --page-bytes is {self.page_bytes}"
        if h.num_pages * h.page_bytes != self.nbytes:
            return f"pool size {h.num_pages * h.page_bytes}, --host-pool-bytes is {self.nbytes}"
        if h.inode != st.st_ino:
            return "its index belongs to another segment (inode differs)"
        self.replayed = found
        return None

    def attach(self, pool: HostPool) -> Adoption:
        """What to adopt of what the index held (if the pool kept its segment), with a fresh
        index for the store. Logs one line saying what happened."""
        inode = os.fstat(pool.fileno()).st_ino
        generation = 0
        adoption = Adoption(None)
        if pool.adopted and self.replayed is not None:
            found = self.replayed
            adoption = adopt(pool, found, self.settings)
            adopted = adoption.adopted
            generation = found.header.generation + 1
            log.info(
                "warm restart: adopted %s (%d bytes), %s and %s of live processes; "
                "%s dropped as invalid, %s refused as a put would%s",
                plural(adopted.entries, "entry"), adopted.nbytes, plural(adopted.holds, "hold"),
                plural(adopted.write_holds, "write"), plural(adopted.dropped_invalid, "record"),
                plural(adopted.dropped_refused, "record"),
                " (a torn tail dropped)" if found.torn else "",
            )  # fmt: skip
        else:
            found = None
            replaced = pool.replaced_because is not None
            entries, nbytes = self._dropped if replaced else (0, 0)
            adopted = Adopted(
                layout_replaced=replaced, dropped_layout=entries, dropped_layout_bytes=nbytes
            )
        counters = adoption.counters
        counters["adopted_entries"] = int(adopted.entries)
        counters["adopted_bytes"] = int(adopted.nbytes)
        counters["adopt_dropped_invalid"] = int(adopted.dropped_invalid)
        counters["adopt_dropped_refused"] = int(adopted.dropped_refused)
        counters["adopt_write_holds"] = int(adopted.write_holds)
        counters["adopt_dropped_layout"] = int(adopted.dropped_layout)
        counters["adopt_dropped_layout_bytes"] = int(adopted.dropped_layout_bytes)
        counters["adopt_layout_replaced"] = int(adopted.layout_replaced)
        header = rec.Header(rec.LAYOUT_VERSION, pool.page_bytes, pool.num_pages, inode, generation)
        adoption.index = index = PoolIndex.create(index_path(pool.path), header, found)
        # 1 when a file at the index's names was refused: not read, written or replaced
        counters["adopt_untrusted_index"] = int(bool(self.untrusted or index.refused))
        adoption.adopted = adopted
        return adoption


def adopt(pool: HostPool, found: Replayed, settings: Settings) -> Adoption:
    """Each valid record of ``found`` as a READY entry (unverified: checked before it is
    served), the holds of processes that still run on them, and the pages live client
    processes may still write (kept out of reuse). Drops from ``found`` what it did not
    adopt (the new index keeps the rest)."""
    pages = pool.num_pages
    refused = _drop_refused(found, settings)
    writing = _live_writes(found, pages)
    invalid = _drop_invalid(found, pages, pool.page_bytes, writing)
    entries: dict[str, Entry] = {}
    for key, a in found.adds.items():
        entry = Entry(key, a.dtype, a.shape, a.nbytes, a.runs, EntryState.READY)
        entry.crc32, entry.unverified = a.crc, True
        entries[key] = entry
    holds: list[Held] = []
    for hold_id, h in list(found.holds.items()):
        held = entries.get(h.key)
        process = ProcessRef(h.pid, h.start)
        if held is None or not process.alive():
            del found.holds[hold_id]  # nothing to keep: the process is gone
            continue
        holds.append(Held(hold_id, held, process, held.num_pages * pool.page_bytes))
    writes = [  # out of reuse until the process exits (the reaper)
        Written(w.write_id, ProcessRef(w.pid, w.start), w.runs, None, 0)
        for w in found.writes.values()
    ]
    nbytes = sum(e.nbytes for e in entries.values())
    adopted = Adopted(len(entries), nbytes, invalid, refused, len(holds), len(writes))
    return Adoption(None, adopted, list(entries.values()), holds, writes)


def _drop_refused(found: Replayed, settings: Settings) -> int:
    """Drop the ADD records a put of the same key, dtype and shape would refuse (the put's
    own checks: ``admission.check_key`` and ``check_meta``, nbytes included), and count
    those that did not decode (already left out by the replay); returns how many. Each is
    logged (the first few in full)."""
    dropped = list(found.skipped)
    for key, a in list(found.adds.items()):
        try:
            admission.check_key(key, settings)
            admission.check_meta(a.dtype.name, a.shape, a.nbytes, settings)
        except EmbCacheError as exc:
            del found.adds[key]
            found.raw.pop(key, None)
            dropped.append(rec.Skipped(str(exc), key))
    for i, skipped in enumerate(dropped):
        if i < _LOGGED:
            key = "?" if skipped.key is None else repr(skipped.key[:64])
            log.warning("warm restart: index record of key %s dropped: %s", key, skipped.reason)
    if len(dropped) > _LOGGED:
        log.warning("warm restart: %d more index records dropped", len(dropped) - _LOGGED)
    return len(dropped)


def _live_writes(found: Replayed, pages: int) -> np.ndarray:
    """Keep the WRITE records of processes that still run (they may be copying into those
    pages through their own mapping) whose runs lie in the pool and overlap no other's;
    drop the rest. Returns the pages they hold (a bool per page)."""
    writing = np.zeros(pages, dtype=bool)
    for write_id, w in list(found.writes.items()):
        inside = all(n > 0 and s >= 0 and s + n <= pages for s, n in w.runs)
        clash = not inside or any(writing[s : s + n].any() for s, n in w.runs)
        if clash or not ProcessRef(w.pid, w.start).alive():
            del found.writes[write_id]
            continue
        for s, n in w.runs:
            writing[s : s + n] = True
    return writing


def _drop_invalid(found: Replayed, pages: int, page_bytes: int, writing: np.ndarray) -> int:
    """Drop the records whose runs leave the pool, do not hold their bytes, or overlap an
    earlier record's or pages a live process may be writing (``writing``); returns how
    many. All runs are checked at once (sorted, with numpy); only when that finds a fault
    are the records checked one by one, in index order."""
    if writing.any():
        return _drop_invalid_slow(found, pages, page_bytes, writing)
    runs = [(s, n) for a in found.adds.values() for s, n in a.runs]
    sizes_ok = all(
        sum(n for _, n in a.runs) == -(-a.nbytes // page_bytes) for a in found.adds.values()
    )
    if runs and sizes_ok:
        flat = np.array(runs, dtype=np.int64)
        flat = flat[np.argsort(flat[:, 0], kind="stable")]
        ends = flat[:, 0] + flat[:, 1]
        positive = (flat[:, 1] > 0).all() and flat[0, 0] >= 0
        disjoint = (flat[1:, 0] >= ends[:-1]).all()  # sorted and disjoint: ends increase
        if positive and disjoint and ends[-1] <= pages:
            return 0  # the usual case: every record is valid
    elif sizes_ok:
        return 0
    return _drop_invalid_slow(found, pages, page_bytes, writing)


def _drop_invalid_slow(found: Replayed, pages: int, page_bytes: int, taken: np.ndarray) -> int:
    taken = taken.copy()
    invalid = 0
    for key, a in list(found.adds.items()):
        ok = sum(n for _, n in a.runs) == -(-a.nbytes // page_bytes) and all(
            n > 0 and s >= 0 and s + n <= pages and not taken[s : s + n].any() for s, n in a.runs
        )
        if not ok:
            invalid += 1
            del found.adds[key]
            continue
        for s, n in a.runs:
            taken[s : s + n] = True
    return invalid


def find_stale(prefix: str, shm_dir: Path) -> str | None:
    """The newest ``<prefix>-*`` segment of this user with an index beside it that no live
    daemon holds (its flock is free): what a daemon without ``--shm-name`` adopts."""
    best: tuple[float, str] | None = None
    for path in shm_dir.glob(f"{prefix}-*"):
        if path.name.endswith(INDEX_SUFFIXES) or not index_path(path).exists():
            continue
        if (st := unheld_segment(path)) is None:
            continue
        if best is None or st.st_mtime > best[0]:
            best = (st.st_mtime, path.name)
    return None if best is None else best[1]
