"""One device pool: a slab of device pages, unified v2p/p2v page tables, residency LRU.

Every resident entry owns one contiguous range of *virtual* pages bound to physical pages
(one consecutive run when possible: ``alloc_bind_inplace``; otherwise ``bind_inplace``).
Eviction tombstones both tables with ``free_unbind_inplace``. The tables live on the
device and are changed only by those kernels; the host keeps allocators that mirror which
pages and vpages are free, so it never reads the tables back.

All the pool's device work (table kernels, copies in and out) runs on one stream. Stream
order is what makes reuse safe: a physical page freed after a copy that read it can only be
written by work queued later on the same stream, so no host sync is needed. Clients read
pages only under a lease, and leased entries are never evicted.

The pool also runs on a CPU "device" (plain memory, no stream): CI uses that to test the
residency, eviction and copy-plan logic without a GPU.
"""

from __future__ import annotations

import contextlib
import secrets
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from embcache.service.device.assign_runs import assign_runs
from embcache.service.device.residency import Residency
from embcache.service.device.table_updates import TableUpdates
from embcache.service.host.allocator import PageRunAllocator
from embcache.service.host.entries import Entry
from embcache.service.host.stats import PoolStats

if TYPE_CHECKING:
    from embcache.service.device.published import PublishedCopies

PAGE_FREE, PAGE_RESIDENT, PAGE_LEASED = 0, 1, 2


class DevicePool:
    """One GPU's device pool (module docstring): ``nbytes`` of ``page_bytes`` pages, the
    slab exported for ``ipc_mode``, and ``peers`` (other served GPUs) allowed to read it.
    ``index`` is the pool's place in the device tier, not a CUDA ordinal."""

    def __init__(
        self,
        device: torch.device,
        nbytes: int,
        page_bytes: int,
        *,
        ipc_mode: str = "fd",
        index: int = 0,
        peers: Sequence[int] = (),
    ) -> None:
        assert nbytes % page_bytes == 0 and nbytes > 0, (nbytes, page_bytes)
        self.device = device
        self.index = index
        self.page_bytes = page_bytes
        self.num_pages = nbytes // page_bytes
        self.num_vpages = 2 * self.num_pages  # room to keep each entry's vpages contiguous
        self.pool_id = f"dev{index}-{uuid.uuid4().hex[:12]}"
        # Secret that entitles a client to this pool's fd (handed out only in authenticated
        # replies); the fd server checks it.
        self.fd_token = secrets.randbits(63)
        self.slab: Any = None  # kernels.cuda_mem.DeviceSlab on a GPU
        if device.type == "cuda":
            from embcache.kernels import cuda_mem

            # ``peers``: the other served GPUs, which copy from this pool (multi-GPU).
            self.slab = cuda_mem.DeviceSlab(device.index or 0, nbytes, ipc_mode, peers)
            self.tensor = self.slab.tensor[:nbytes]
            self.gpu_uuid = cuda_mem.gpu_uuid(device.index or 0)
            self.stream: torch.cuda.Stream | None = torch.cuda.Stream(device)
        else:
            self.tensor = torch.zeros(nbytes, dtype=torch.uint8)
            self.gpu_uuid = f"CPU-{index}"
            self.stream = None
        self.rows = self.tensor.view(-1, 16)  # the view 16-byte-row copy plans use
        self.ipc_mode = ipc_mode if self.slab is not None else "none"
        self.v2p = torch.full((self.num_vpages,), -1, dtype=torch.int64, device=device)
        self.p2v = torch.full((self.num_pages,), -1, dtype=torch.int64, device=device)
        self._pages = PageRunAllocator(self.num_pages)
        self._vpages = PageRunAllocator(self.num_vpages)
        self._resident: OrderedDict[Entry, Residency] = OrderedDict()
        self.tables = TableUpdates(self.v2p, self.p2v, self.on_stream)  # not launched yet
        self._legacy_handle: bytes | None = None
        self.failed = False  # a device error took the pool out of service
        self.failure = ""
        self.evictions = 0
        self.free_target = 0  # pages evict_to_free_target() keeps free (the tier sets it)
        self.hits = 0
        self.loads = 0
        # The copies the read table offers same-node clients (None: no table); told first
        # whenever a copy leaves, before its pages go back to the allocator.
        self.published: PublishedCopies | None = None

    # -- residency -----------------------------------------------------------------------
    def lookup(self, entry: Entry) -> Residency | None:
        """``entry``'s copy here, if any, marked as just used (LRU)."""
        res = self._resident.get(entry)
        if res is not None:
            self._resident.move_to_end(entry)
        return res

    def peek(self, entry: Entry) -> Residency | None:
        """The residency without touching the LRU order."""
        return self._resident.get(entry)

    def fail(self, reason: str) -> None:
        """Take the pool out of service after a device error; forget what it held."""
        self.failed = True
        self.failure = reason or "device error"
        # Its offers in the read table stay until the tier's next sweep under the engine's
        # lock (this may run outside it, after a wait): its pages are never reused now.
        self._resident.clear()
        self.tables.clear()

    def is_resident(self, entry: Entry) -> bool:
        """Whether ``entry`` has a copy here (finished or still being copied)."""
        return entry in self._resident

    def resident_bytes(self, entry: Entry) -> int | None:
        """Bytes of the pages ``entry``'s copy here holds; None when it has none."""
        res = self._resident.get(entry)
        return None if res is None else res.npages * self.page_bytes

    def pages_for(self, nbytes: int) -> int:
        """Device pages an entry of ``nbytes`` takes."""
        return -(-nbytes // self.page_bytes)

    def reserve_batch(self, entries: list[Entry]) -> list[Residency] | None:
        """Pick pages for ``entries``, evicting unleased residents LRU, with two allocator
        calls for the whole batch. Host bookkeeping only: :meth:`bind` and :meth:`flush`
        then update the device tables (this batch's evictions are tombstoned first).

        All or nothing: None (and nothing reserved) when the batch does not fit after
        evicting every unleased resident. The batch's virtual pages are one range, cut
        into one sub-range per entry; its physical runs are dealt out so that every entry
        that fits in one piece of them gets one run (see ``assign_runs``).
        """
        sizes = [self.pages_for(e.nbytes) for e in entries]
        total = sum(sizes)
        if total > self.num_pages:
            return None
        while self._pages.num_free_pages < total or self._vpages.largest_free_run < total:
            if self._evict_one() is None:
                return None
        vruns = self._vpages.allocate(total)
        runs = self._pages.allocate(total)
        assert vruns is not None and len(vruns) <= 1 and runs is not None, (vruns, runs)
        vstart = vruns[0][0] if vruns else 0
        out: list[Residency] = []
        for entry, n, mine in zip(entries, sizes, assign_runs(runs, sizes), strict=True):
            res = Residency(vstart, n, mine)
            vstart += n
            self._resident[entry] = res
            out.append(res)
        self.loads += len(out)
        return out

    def bind(self, batch: list[Residency]) -> None:
        """Queue the batch's bindings for v2p/p2v; :meth:`flush` launches them."""
        self.tables.bind(batch)

    def flush(self) -> None:
        """Launch the queued table updates (``table_updates.py``). Copies never read the
        tables, so updates may lag behind them; whoever reads the tables flushes first."""
        self.tables.flush()

    def flush_if_due(self) -> bool:
        """:meth:`flush` once the oldest queued update is ``flush_every_s`` old (or too many
        wait); True when it launched."""
        return self.tables.flush_if_due()

    @property
    def tables_pending(self) -> bool:
        """True while table updates wait for :meth:`flush`."""
        return self.tables.pending

    @property
    def flush_every_s(self) -> float:
        """Longest the table updates wait to be launched together (the tier sets it)."""
        return self.tables.flush_every_s

    @flush_every_s.setter
    def flush_every_s(self, seconds: float) -> None:
        self.tables.flush_every_s = seconds

    def _evict_one(self) -> Residency | None:
        """Forget the least recently used unleased copy; its residency (None: all leased)."""
        for entry, res in self._resident.items():
            if entry.ref_cnt == 0:
                self._forget(entry)
                self.evictions += 1
                return res
        return None

    def evict_to_free_target(self) -> int:
        """Evict unleased copies, least recently used first, until ``free_target`` pages
        (and as many consecutive virtual pages) are free, so a cold get of up to that many
        pages reserves them without evicting on its path; returns how many went. Host
        bookkeeping only: the next flush tombstones them."""
        count = 0
        target = self.free_target
        while target and (
            self._pages.num_free_pages < target or self._vpages.largest_free_run < target
        ):
            if self._evict_one() is None:
                break
            count += 1
        return count

    def drop(self, entry: Entry) -> None:
        """Forget ``entry``'s device copy now (the caller knows nobody holds it)."""
        if self._forget(entry):
            self.flush_if_due()

    def _forget(self, entry: Entry) -> bool:
        """Free the pages on the host side; the tables are tombstoned by the next flush."""
        res = self._resident.pop(entry, None)
        if res is None:
            return False
        if self.published is not None:  # readers stop using the pages before any reuse
            self.published.forget(entry)
        if res.npages:
            self.tables.unbind(res.vstart, res.npages)
            self._vpages.free([(res.vstart, res.npages)])
            self._pages.free(list(res.runs))
        return True

    def evict_unleased(self) -> int:
        """Forget every unleased copy (tests: make the next gets cold); returns how many."""
        count = 0
        while self._evict_one() is not None:
            count += 1
        self.flush_if_due()
        return count

    def evict_entries(self, entries: list[Entry]) -> int:
        """Forget these entries' copies (the caller checked nobody holds them); their
        table updates join the queue (:meth:`flush_if_due`). Returns how many had a copy here."""
        count = sum(1 for entry in entries if self._forget(entry))
        self.evictions += count
        self.flush_if_due()
        return count

    def evict_bytes(self, nbytes: int) -> tuple[int, int]:
        """Evict unleased residents, least recently used first, until ``nbytes`` of pages
        are free again or none is left: (entries, bytes of pages freed)."""
        count = freed = 0
        while freed < nbytes and (res := self._evict_one()) is not None:
            freed += res.npages * self.page_bytes
            count += 1
        self.flush_if_due()
        return count, freed

    def on_stream(self) -> contextlib.AbstractContextManager[object]:
        """Work queued inside goes to the pool's stream (nothing on a CPU pool)."""
        if self.stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.stream)

    # -- export --------------------------------------------------------------------------
    def export_legacy(self) -> bytes:
        """The slab's ``cudaIpcMemHandle`` (made once); RuntimeError on a CPU pool."""
        if self.slab is None:
            raise RuntimeError("a CPU device pool has no IPC handle")
        if self._legacy_handle is None:
            self._legacy_handle = self.slab.export_legacy()
        return self._legacy_handle

    def export_fd(self) -> int:
        """A new POSIX fd of the slab (the caller closes it); RuntimeError on a CPU pool."""
        if self.slab is None:
            raise RuntimeError("a CPU device pool has no IPC handle")
        return self.slab.export_fd()

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.page_bytes

    # -- views ---------------------------------------------------------------------------
    def byte_runs(self, res: Residency) -> list[tuple[int, int]]:
        """``res``'s pages as ``(offset, length)`` byte runs of the slab (whole pages)."""
        return [(s * self.page_bytes, k * self.page_bytes) for s, k in res.runs]

    def page_ids(self, res: Residency) -> list[int]:
        """The physical page ids of ``res``, in order (what a reply of pages carries)."""
        return [p for s, k in res.runs for p in range(s, s + k)]

    def stats(self) -> PoolStats:
        """Sizes and fragmentation of the physical pages (``out_of_service`` says why)."""
        free = self._pages.num_free_pages
        used = self.num_pages - free
        return PoolStats(
            f"device:{self.index}",
            self.num_pages * self.page_bytes,
            used * self.page_bytes,
            free * self.page_bytes,
            self.page_bytes,
            self.num_pages,
            used,
            free,
            self._pages.largest_free_run,
            self._pages.num_free_runs,
            self.failure if self.failed else "",
        )

    @property
    def resident_entries(self) -> int:
        return len(self._resident)

    def check_tables(self) -> None:
        """Assert that the device tables agree with the host side: v2p and p2v are inverse,
        each residency's vpages map to its runs, and as many pages are bound as the
        allocator holds. Flushes, then reads the tables back: tests and debugging."""
        self.flush()
        v2p, p2v = self.v2p.tolist(), self.p2v.tolist()
        bound = {v: p for v, p in enumerate(v2p) if p >= 0}
        assert {p: v for v, p in bound.items()} == {p: v for p, v in enumerate(p2v) if v >= 0}
        for res in self._resident.values():
            pages = [p for s, k in res.runs for p in range(s, s + k)]
            assert [v2p[res.vstart + j] for j in range(res.npages)] == pages, res
        assert len(bound) == self.num_pages - self._pages.num_free_pages, "bound != used"

    def page_states(self) -> np.ndarray:
        """One uint8 per physical page: 0 free, 1 resident, 2 leased (the pool map)."""
        states = np.zeros(self.num_pages, dtype=np.uint8)
        for entry, res in self._resident.items():
            for s, k in res.runs:
                states[s : s + k] = PAGE_LEASED if entry.ref_cnt else PAGE_RESIDENT
        return states

    def close(self) -> None:
        """Forget every copy and queued update, and free the slab."""
        if self.published is not None:
            self.published.forget_all()
        self._resident.clear()
        self.tables.clear()  # a flush scheduled before the close finds nothing to do
        if self.slab is not None:
            self.slab.close()
