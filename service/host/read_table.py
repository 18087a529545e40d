"""The daemon's side of the read table: same-node clients copy entries without a call.

A small host get through the session socket costs a few hundred microseconds, almost all
of it the call (docs/facts.md, "Small calls stamp by stamp"), while the copy itself takes a
few. Clients on the node map the host pool already; this table tells them where a READY
entry's bytes are, so a get of a small entry as a copy is a lookup and a memcpy in the
client's own process (``proto/read_table.py`` for the bytes, ``docs/same_node_reads.md``).

The host store keeps it in step (``store.py``): an entry is published once it is READY
and its bytes are trusted (a warm restart's adopted entries once their CRC32 passed), and
withdrawn before its pages can be reused: eviction, a corrupt entry's drop, the daemon's
drain or close. The device tier adds, in an entry's slot, where the entry is resident in
its device pools (:meth:`ReadTable.place`, once the copy into those pages is complete) and
takes that out again before those device pages can be reused (:meth:`ReadTable.unplace`).
Only the daemon writes, under the engine's lock; every change of a slot is
bracketed by its sequence number (odd while it changes), which is what lets a reader check
its copy afterwards. No reader holds anything: a client that dies mid-copy leaves nothing
behind, and nothing a client does can change the file (it maps it read-only).

A starting daemon marks an older table at the same path closed before it replaces it, so
the clients of a daemon whose segment is adopted (warm restart) stop using their mapping
before any page of it is reused. Only a table of the daemon's own uid is touched so: a file
another local user put at the name first is refused (no table: gets stay calls), and the
new table is created exclusively, never through a symlink (``shm_files.py``).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
from pathlib import Path

from embcache.proto import read_table as rt
from embcache.service.host.entries import Entry
from embcache.service.host.shm_files import UntrustedFile, clear_own, create_exclusive

log = logging.getLogger(__name__)

MAX_BUCKETS = 1 << 17  # 1M slots, 512 MiB of address space at most (a sparse file)


def table_path(segment: Path) -> Path:
    """The read table of the host pool segment at ``segment``."""
    return segment.with_name(segment.name + rt.SUFFIX)


def buckets_for(max_entries: int) -> int:
    """Buckets for a table that fits ``max_entries`` with room to spare (half full on
    average, so a full bucket is rare: an entry that finds one is only not published)."""
    want = max(1, -(-2 * max_entries // rt.WAYS))
    return min(MAX_BUCKETS, 1 << (want - 1).bit_length())


class ReadTable:
    """The read table of one host pool (module docstring). Build it with :meth:`create`."""

    def __init__(self, path: Path, fd: int, mm: mmap.mmap, num_buckets: int) -> None:
        self.path = path
        self.num_buckets = num_buckets
        self._fd = fd
        self._mm = mm
        self._view = memoryview(mm)
        self._slot_of: dict[str, int] = {}  # key -> offset of its slot
        self._entry_of: dict[str, Entry] = {}  # key -> the entry its slot describes
        st = os.fstat(fd)
        # (st_dev, st_ino, size) of the file, for clients to check what they map
        self.identity = (st.st_dev, st.st_ino, st.st_size)
        self.skipped = 0  # entries not published (bucket full, too many runs or dims)
        self.device_published = 0  # device sections written (an entry resident in a pool)
        self.device_withdrawn = 0  # device sections cleared (evicted there, or withdrawn)
        self.device_skipped = 0  # residencies not offered: too many runs, no section free
        self.closed = False

    @classmethod
    def create(
        cls, segment: Path, *, num_buckets: int, page_bytes: int, mode: int = 0o600
    ) -> ReadTable:
        """A new, empty table beside ``segment`` (any older one there is marked closed and
        replaced: its clients fall back to calls before any page is reused)."""
        path = table_path(segment)
        close_stale(path)
        size = rt.file_bytes(num_buckets)
        # Readable as the segment is (clients map it read-only); only the daemon writes it.
        fd = create_exclusive(path, mode & ~0o022, os.O_RDWR)
        try:
            os.ftruncate(fd, size)  # sparse: only written slots take memory
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        rt.HEADER.pack_into(
            mm, 0, rt.MAGIC, rt.VERSION, rt.SLOT_BYTES, rt.WAYS, rt.MAX_DIMS, rt.MAX_RUNS, 0,
            num_buckets, page_bytes, 0,
        )  # fmt: skip
        rt.DEVICE_HEADER.pack_into(mm, rt.DEVICE_HEADER_AT, rt.DEVICE_SECTIONS, rt.DEVICE_RUNS)
        return cls(path, fd, mm, num_buckets)

    def __len__(self) -> int:
        return len(self._slot_of)

    def publish(self, entry: Entry) -> bool:
        """Make a READY entry readable from the table; False (and counted in ``skipped``)
        when it does not fit: its bucket is full, or it has too many runs or dimensions."""
        if self.closed:
            return False
        assert entry.key not in self._slot_of, f"{entry.key!r} published twice"
        code = rt.CODE_OF.get(entry.dtype.name)
        if len(entry.runs) > rt.MAX_RUNS or len(entry.shape) > rt.MAX_DIMS or code is None:
            self.skipped += 1
            return False
        key_digest = rt.digest(entry.key)
        base = rt.slot_offset(rt.bucket_of(key_digest, self.num_buckets), 0)
        free = (base + w * rt.SLOT_BYTES for w in range(rt.WAYS))
        at = next((a for a in free if not self._view[a + rt.LIVE_AT]), None)
        if at is None:  # the bucket is full
            self.skipped += 1
            return False
        shape = (*entry.shape, *(0,) * (rt.MAX_DIMS - len(entry.shape)))
        runs = [x for run in entry.runs for x in run]
        runs += [0] * (2 * rt.MAX_RUNS - len(runs))
        seq = self._begin(at)
        body = (key_digest, entry.nbytes, 1, code, len(entry.shape), len(entry.runs))
        rt.BODY.pack_into(self._view, at + rt.SEQ.size, *body, *shape, *runs)
        self._end(at, seq)
        self._slot_of[entry.key] = at
        self._entry_of[entry.key] = entry
        return True

    def withdraw(self, key: str) -> bool:
        """Take ``key`` out of the table (before its pages can be reused); False if it was
        not in it. A reader copying it meanwhile sees the slot's sequence change."""
        at = self._slot_of.pop(key, None)
        if at is None:
            return False
        del self._entry_of[key]
        self.device_withdrawn += sum(1 for _ in self._sections(at))
        seq = self._begin(at)
        self._view[at + rt.SEQ.size : at + rt.SLOT_BYTES] = bytes(rt.SLOT_BYTES - rt.SEQ.size)
        self._end(at, seq)
        return True

    def place(self, entry: Entry, pool: int, runs: tuple[tuple[int, int], ...]) -> bool:
        """Offer ``entry``'s copy in device pool ``pool`` (its index in the list sessions
        announce): its page runs there, in that pool's pages. Only once the copy that filled
        those pages is complete, and only for an entry whose slot is this very entry's (a
        newer entry under the same key is not described by an older one's copy). Rewrites
        the pool's section if the slot has one. False when it is not offered: no slot, or
        too many runs, or every section taken by other pools (those two counted)."""
        at = self._slot_of.get(entry.key)
        if at is None or self._entry_of[entry.key] is not entry:
            return False
        try:
            section = rt.pack_device(pool, runs)
        except ValueError:
            self.device_skipped += 1
            return False
        used = dict(self._sections(at))
        free = [i for i in range(rt.DEVICE_SECTIONS) if i not in used.values()]
        index = used.get(pool, free[0] if free else None)
        if index is None:
            self.device_skipped += 1
            return False
        where = rt.device_at(at, index)
        seq = self._begin(at)
        self._view[where : where + rt.DEVICE.size] = section
        self._end(at, seq)
        self.device_published += 1
        return True

    def unplace(self, entry: Entry, pool: int) -> bool:
        """Stop offering ``entry``'s copy in device pool ``pool`` (before those device pages
        can be reused); False when the table did not offer it. A reader copying it meanwhile
        sees the slot's sequence change."""
        at = self._slot_of.get(entry.key)
        if at is None or self._entry_of[entry.key] is not entry:
            return False
        index = dict(self._sections(at)).get(pool)
        if index is None:
            return False
        where = rt.device_at(at, index)
        seq = self._begin(at)
        self._view[where : where + rt.DEVICE.size] = bytes(rt.DEVICE.size)
        self._end(at, seq)
        self.device_withdrawn += 1
        return True

    def device_sections(self, key: str) -> dict[int, tuple[tuple[int, int], ...]]:
        """The device runs ``key``'s slot offers, by pool (tests and debugging)."""
        at = self._slot_of.get(key)
        if at is None:
            return {}
        out = {}
        for pool, index in self._sections(at):
            found = rt.unpack_device(self._view, rt.device_at(at, index))
            assert found is not None and found[0] == pool
            out[pool] = found[1]
        return out

    def _sections(self, at: int) -> list[tuple[int, int]]:
        """``(pool, section index)`` of the live device sections of the slot at ``at``."""
        view = self._view
        out = []
        for i in range(rt.DEVICE_SECTIONS):
            where = rt.device_at(at, i)
            if view[where]:
                out.append((view[where + 1], i))
        return out

    def _begin(self, at: int) -> int:
        """Mark the slot at ``at`` as changing (its sequence odd); returns the old value."""
        (seq,) = rt.SEQ.unpack_from(self._view, at)
        rt.SEQ.pack_into(self._view, at, seq + 1)
        return int(seq)

    def _end(self, at: int, seq: int) -> None:
        rt.SEQ.pack_into(self._view, at, seq + 2)

    def shut(self) -> None:
        """Tell readers to stop using the table (the daemon drains or closes): every key is
        asked of the daemon from now on. Idempotent."""
        if not self.closed:
            self.closed = True
            rt.SEQ.pack_into(self._view, rt.CLOSED_AT, 1)
            for at in self._slot_of.values():  # copies in progress see the change too
                self._end(at, self._begin(at))
            self._slot_of.clear()
            self._entry_of.clear()

    def remove(self) -> None:
        """Shut the table and remove its file (the daemon is closing). Idempotent."""
        self.shut()
        if self._fd < 0:
            return
        with contextlib.suppress(OSError):
            if os.fstat(self._fd).st_ino == self.path.stat().st_ino:
                self.path.unlink()  # ours still, not a newer daemon's
        self._view.release()
        self._mm.close()
        os.close(self._fd)
        self._fd = -1


def close_stale(path: Path) -> None:
    """Mark an existing table at ``path`` closed (its readers fall back to calls) and
    remove it; nothing when there is none. One this uid does not own is refused
    (UntrustedFile: neither written nor removed); a symlink of ours is only removed."""
    clear_own(path, remove=False)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    except OSError:  # a symlink of ours (ELOOP), say: nothing to mark, only the name goes
        path.unlink(missing_ok=True)
        return
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():  # put there after the check above
            raise UntrustedFile(f"{path.name} belongs to uid {st.st_uid}: refused")
        if st.st_size >= rt.HEADER_BYTES:
            with mmap.mmap(fd, rt.HEADER_BYTES, flags=mmap.MAP_SHARED) as mm:
                if mm[: len(rt.MAGIC)] == rt.MAGIC:
                    rt.SEQ.pack_into(mm, rt.CLOSED_AT, 1)
                    log.info("closed the read table %s left by an earlier daemon", path.name)
    finally:
        os.close(fd)
    path.unlink(missing_ok=True)
