"""Stashed puts: pages a same-node client fills ahead of its puts, and their commits.

A client with the daemon's uid writes its puts itself, into a stash of free pages the
daemon holds for its process (``host/stash.py`` says how those pages are kept safe). This
part hands out stashes and commits what was written into them. A commit is checked the way
a put is (``host/admission.py``) before the gate is taken, and each entry's CRC32, where
asked for or needed by the warm-restart index, is computed over its pages then too: the
pages are the stash's until the commit takes them, so nothing else writes them meanwhile.
Under the gate the store takes the pages and makes the entries READY, all or nothing.

Owned by :class:`~embcache.service.engine.engine.CacheEngine` (``engine.stash``), over the
engine's store, tier and gate; it holds no reference to the engine.
"""

from __future__ import annotations

from collections.abc import Sequence

from embcache.errors import ChecksumMismatch, PermissionDenied
from embcache.service.config import Settings
from embcache.service.device.tier import DeviceTier
from embcache.service.engine.gate import Gate
from embcache.service.engine.hooks import SharedCalls
from embcache.service.host import admission
from embcache.service.host.quarantine import ProcessRef
from embcache.service.host.stash import Stashed, StashedPut, pages_of
from embcache.service.host.store import HostStore
from embcache.service.host.verify import byte_runs_crc


class StashPath:
    """Stashes and their commits (module docstring)."""

    def __init__(
        self,
        settings: Settings,
        store: HostStore,
        tier: DeviceTier,
        gate: Gate,
        shared: SharedCalls,
    ) -> None:
        self._settings = settings
        self._store = store
        self._tier = tier
        self._gate = gate
        self._shared = shared  # told of each new entry, outside the gate

    def refill(
        self, owner: str, writer: tuple[str, int], nbytes: int, extra_bytes: int = 0
    ) -> list[tuple[int, int]]:
        """Free pages, at least ``nbytes`` and up to ``extra_bytes`` more where that many
        are free without evicting, held for the process of session ``writer[0]`` as a
        stash its client knows by ``writer[1]``: their byte runs in the pool.

        Args:
            owner: whose in-flight put quota the pages count against until committed.
        Raises:
            QuotaExceeded, PoolExhausted; PermissionDenied when the daemon knows no process
            for the session; Draining.
        """
        npages = self._store.pages_for(max(nbytes, 1))
        extra = extra_bytes // self._store.pool.page_bytes
        with self._gate:
            self._gate.check_open()
            process = writer_process(self._store, writer[0])
            if not process.alive():  # its stash would wait for the reaper: none
                raise PermissionDenied("the process has exited", owner=writer[0])
            quota = self._settings.inflight_limit
            runs = self._store.refill_stash(
                owner, process, writer[1], npages, quota=quota, extra=extra
            )
        pool = self._store.pool
        return pool.byte_runs(runs, sum(n for _, n in runs) * pool.page_bytes)

    def commit(self, owner: str, writer: tuple[str, int], puts: Sequence[StashedPut]) -> list[bool]:
        """Make puts written into the stash ``writer[1]`` READY and visible, all or nothing;
        per put, whether it was created (False: the key was stored with the same metadata).

        Raises:
            InvalidArgument, EntryTooLarge (a put or its runs), NotFound (no such stash),
            ChecksumMismatch, MetadataConflict, PoolExhausted, PermissionDenied, Draining:
            none is visible. Past the validation, every page the puts name has left the
            stash (``host/stash.py``).
        """
        pool = self._store.pool
        checked: list[Stashed] = []
        for put in puts:
            key = admission.check_key(put.key, self._settings)
            meta = admission.check_meta(put.dtype, put.shape, put.nbytes, self._settings)
            want = admission.check_checksum(put.checksum)
            runs = pages_of(put.byte_runs, meta.nbytes, pool.page_bytes, pool.num_pages)
            crc = refused = None
            if want is not None or self._settings.warm_restart:
                crc = byte_runs_crc(pool, pool.byte_runs(runs, meta.nbytes))
                if want is not None and crc != want:
                    refused = ChecksumMismatch(
                        "the stashed bytes do not match their checksum",
                        key=key, expected=want, actual=crc,
                    )  # fmt: skip
            checked.append(Stashed(key, meta, runs, crc, refused, want))
        with self._gate:
            self._gate.check_open()
            process = writer_process(self._store, writer[0])
            done = self._store.commit_stashed(process, writer[1], checked, self._gate.clock())
        for entry, created in done:
            if created:
                self._tier.prepare(entry)
                self._shared.on_commit(entry.key, owner)
        return [created for _, created in done]

    def give_back(self, owner: str, token: int) -> bool:
        """The process of session ``owner`` is done with the stash it knows by ``token``:
        what is left of it goes back now. False when that process holds none by that id."""
        with self._gate:
            process = self._store.processes.get(owner)
            return process is not None and self._store.writer_done(process, token)


def writer_process(store: HostStore, owner: str) -> ProcessRef:
    """The process of session ``owner``, which fills pages itself; PermissionDenied when
    the daemon knows none (it could not keep those pages from reuse while it writes)."""
    process = store.processes.get(owner)
    if process is None:
        raise PermissionDenied(
            "the daemon cannot see this process (no pid for it here), so it may not fill "
            "pages itself: put the bytes inline or streamed",
            owner=owner,
        )
    return process
