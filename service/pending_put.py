"""Puts from device memory whose copies are queued but not yet waited for.

:func:`start_puts` queues each item's device -> host copy as early as it can: into pages
from the put landing before the item is checked and recorded (``put_landing.py``), else as
soon as its pages are reserved (the copy engine moves one tensor while the next is
reserved), then records one event per stream. The caller waits its own way (an event loop polls
``done()``, a thread calls ``wait()``), then ``finish()`` checks the checksums and commits
the batch, all or nothing; ``abort()`` gives the pages back once the copies that write them
are complete. The source tensors must stay readable until either returns. Nothing of the
batch is visible before ``finish()``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from embcache import kernels

from .copy_plan import row_bytes_for
from .dtypes import from_torch
from .errors import InvalidArgument
from .fill import PutHandle

if TYPE_CHECKING:
    from .device_tier import DeviceTier


class PendingPut:
    """The queued copies of one batch of puts (see the module's docstring)."""

    def __init__(
        self,
        tier: DeviceTier,
        handles: list[PutHandle],
        stack: contextlib.ExitStack,
        events: list[torch.cuda.Event],
        nbytes: int,
        start: float,
    ) -> None:
        self._tier = tier
        self._handles = handles
        self._stack = stack  # aborts every put not committed when it closes
        self._events = events
        self.loaded_bytes = nbytes  # bytes copied into the host pool
        self._start = start
        self._ended = False

    def done(self) -> bool:
        """True once every copy has completed (never blocks)."""
        self._events = [ev for ev in self._events if not ev.query()]
        return not self._events

    def wait(self) -> None:
        for ev in self._events:
            ev.synchronize()
        self._events = []

    def finish(self) -> list[bool]:
        """Wait for the copies if need be, check the checksums, commit: True per created
        entry. On any error none of the batch becomes visible."""
        if self._ended:
            raise RuntimeError("this put has ended already")
        self._ended = True
        with self._stack:
            self.wait()
            if self.loaded_bytes:
                self._tier._observe("d2h", self.loaded_bytes, time.perf_counter() - self._start)
            for handle in self._handles:  # every checksum before any commit
                if handle.has_checksum:
                    handle.filled()
            return [handle.commit() for handle in self._handles]

    def abort(self) -> None:
        """Give back every page once the copies into them have completed."""
        if self._ended:
            return
        self._ended = True
        try:
            self.wait()
        finally:
            self._stack.close()


def start_puts(
    tier: DeviceTier,
    items: Sequence[tuple[str, torch.Tensor]],
    owner: str,
    checksums: Sequence[int | None] | None = None,
) -> PendingPut:
    """Reserve pages for every item and queue its copy; raises (with nothing reserved)
    on bad input or when the pool has no room."""
    if len(items) > 1 and len({key for key, _ in items}) != len(items):
        raise InvalidArgument("a key appears more than once in the batch")
    if checksums is None:
        checksums = [None] * len(items)
    elif len(checksums) != len(items):
        raise InvalidArgument("one checksum per item", items=len(items), checksums=len(checksums))
    dtypes = [_source_dtype(src) for _, src in items]
    e = tier._engine
    start = time.perf_counter()
    streams: dict[int, torch.cuda.Stream] = {}
    nbytes = 0
    with contextlib.ExitStack() as stack:  # aborts every put reserved so far if we raise
        handles = []
        try:
            for (key, src), dtype, crc in zip(items, dtypes, checksums, strict=True):
                handle = _begin(tier, key, src, dtype, owner, crc, streams)
                stack.enter_context(handle)
                handles.append(handle)
                e.top_up_landing()  # for the next put, while this copy runs
                if handle.exists_already:
                    handle.skip_bytes()
                    continue
                nbytes += handle.nbytes
            for handle in handles:  # while the copies run: what a first get needs planned
                if not handle.exists_already:
                    tier.prepare(handle.entry)
            if nbytes:  # counted as queued, in the copies' shadow
                e._count_copy("d2h", nbytes)
        except BaseException:
            for stream in streams.values():  # freed pages must not still be copied into
                stream.synchronize()
            raise
        events = [ev for ev in map(tier._record, streams.values()) if ev is not None]
        return PendingPut(tier, handles, stack.pop_all(), events, nbytes, start)


def _begin(
    tier: DeviceTier,
    key: str,
    src: torch.Tensor,
    dtype: str,
    owner: str,
    crc: int | None,
    streams: dict[int, torch.cuda.Stream],
) -> PutHandle:
    """Begin the put of ``src`` with its copy queued as early as it can be: into pages
    from the put landing before anything else (``put_landing.py``), else the moment
    ``begin_put`` has reserved pages (its ``copy_in``). Adds the copy's stream to
    ``streams``. Raises with nothing reserved and no copy left running."""
    e = tier._engine
    stream = tier._stream_for(src)
    shape = tuple(src.shape)

    def copy(byte_runs: tuple[tuple[int, int], ...]) -> None:
        try:
            _queue_d2h(tier, src, byte_runs, stream)
        except BaseException:  # the pages go back at once: no copy may still run into them
            _finish_stream(stream)
            raise

    pages = e.landing_copy(key, src.numel() * src.element_size(), copy)
    if pages is None:
        handle = e.begin_put(key, dtype, shape, owner=owner, checksum=crc, copy_in=copy)
    else:
        adopted = False
        try:  # checked and recorded while the copy engine works
            handle = e.begin_put(key, dtype, shape, owner=owner, checksum=crc, pages=pages)
            adopted = not handle.exists_already  # else stored meanwhile by another put
        finally:
            if not adopted:  # the pages go back once the copy into them is done
                _finish_stream(stream)
                e.return_landing(pages)
    if stream is not None and not handle.exists_already:
        streams[id(stream)] = stream
    return handle


def _finish_stream(stream: torch.cuda.Stream | None) -> None:
    if stream is not None:
        stream.synchronize()


def _source_dtype(src: torch.Tensor) -> str:
    """The dtype name of a tensor a put may copy from; InvalidArgument if it may not."""
    dt = from_torch(src.dtype)
    if dt is None:
        raise InvalidArgument("unsupported dtype", dtype=str(src.dtype))
    if not src.is_contiguous():
        raise InvalidArgument("source tensor must be contiguous")
    return dt.name


def _queue_d2h(
    tier: DeviceTier,
    src: torch.Tensor,
    byte_runs: tuple[tuple[int, int], ...],
    stream: torch.cuda.Stream | None,
) -> None:
    """Queue the copy of contiguous ``src`` into the host byte runs (filled in order) on
    ``stream``, the put stream of ``src``'s device (None: a CPU tensor, copied at once).

    Runs of copy-engine size go straight to the copy engine (``copy_to_host_runs``: a put
    waits for its copy, so the host time before it counts); small runs, or a backend forced
    in the settings, take ``transfer_ranges``' general path."""
    total = sum(n for _, n in byte_runs)
    if not total:
        return
    host = tier._engine.host_pool
    if stream is not None:
        # An in-process producer may still be writing src on its stream: the copy waits for
        # that stream's work, unless it has none left (a query costs less than a wait).
        index = src.get_device()
        if not kernels.current_stream_idle(index):
            stream.wait_stream(torch.cuda.current_stream(index))
    big = len(byte_runs) == 1 or total >= len(byte_runs) * tier._config.copy_engine_from_bytes
    if tier._engine.settings.copy_backend == "auto" and big:
        if stream is not None and host.registered:
            # What copy_to_host_runs would check holds here: src is contiguous on the
            # stream's device (checked before), the pool registered through the CUDA runtime,
            # and the runs are the allocator's, adding up to src's bytes (begin_put sized
            # them from its shape).
            kernels.queue_to_host_runs(src, host.tensor.data_ptr(), byte_runs, stream)
            return
        kernels.copy_to_host_runs(
            src, host.tensor, list(byte_runs), stream=stream, host_registered=host.registered
        )
        return
    flat = src.reshape(-1).view(torch.uint8)
    row = row_bytes_for(flat.data_ptr(), total, *(off for off, _ in byte_runs))
    lengths = np.array([n for _, n in byte_runs], dtype=np.int64)
    dst_rows = np.array([off for off, _ in byte_runs], dtype=np.int64) // row
    src_rows = (np.cumsum(lengths) - lengths) // row
    tier._transfer(
        flat.view(-1, row), host.tensor.view(-1, row), src_rows, dst_rows, lengths // row, stream
    )
