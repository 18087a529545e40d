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
from embcache.errors import InvalidArgument
from embcache.kernels import _cudart
from embcache.kernels._cudart import CudaRuntime, StreamEvent
from embcache.kernels._env import on_device
from embcache.kernels.host_runs import MEMCPY_MAX_RUNS
from embcache.proto.dtypes import from_torch
from embcache.service.device.copy_plan import row_bytes_for
from embcache.service.host.put_writer import PutHandle

if TYPE_CHECKING:
    from embcache.service.device.tier import DeviceTier


class PendingPut:
    """The queued copies of one batch of puts (see the module's docstring)."""

    def __init__(
        self,
        tier: DeviceTier,
        handles: list[PutHandle],
        stack: contextlib.ExitStack,
        events: list[torch.cuda.Event | StreamEvent],
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
    *,
    src_ready: bool = False,
) -> PendingPut:
    """Reserve pages for every item and queue its copy; raises (with nothing reserved)
    on bad input or when the pool has no room.

    Each copy follows the work queued so far on the caller's current stream (a producer
    may still be writing its tensor there): it is queued on that stream itself, or on the
    device's put stream after it. ``src_ready``: the caller knows every tensor is written
    already (the daemon waited for the client's event), so the copies follow nothing."""
    if len(items) > 1 and len({key for key, _ in items}) != len(items):
        raise InvalidArgument("a key appears more than once in the batch")
    if checksums is None:
        checksums = [None] * len(items)
    elif len(checksums) != len(items):
        raise InvalidArgument("one checksum per item", items=len(items), checksums=len(checksums))
    dtypes = [_source_dtype(src) for _, src in items]
    e = tier._engine
    start = time.perf_counter()
    # what the copies were queued on, by (device, stream handle)
    streams: dict[tuple[int, int], torch.cuda.Stream | _CallerStream] = {}
    nbytes = 0
    with contextlib.ExitStack() as stack:  # aborts every put reserved so far if we raise
        handles = []
        try:
            for (key, src), dtype, crc in zip(items, dtypes, checksums, strict=True):
                handle = _begin(tier, key, src, dtype, owner, crc, streams, src_ready)
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
            events = [_record(tier, stream) for stream in streams.values()]
        except BaseException:
            for stream in streams.values():  # freed pages must not still be copied into
                stream.synchronize()
            raise
        return PendingPut(tier, handles, stack.pop_all(), events, nbytes, start)


def _begin(
    tier: DeviceTier,
    key: str,
    src: torch.Tensor,
    dtype: str,
    owner: str,
    crc: int | None,
    streams: dict[tuple[int, int], torch.cuda.Stream | _CallerStream],
    src_ready: bool,
) -> PutHandle:
    """Begin the put of ``src`` with its copy queued as early as it can be: into pages
    from the put landing before anything else (``put_landing.py``), else the moment
    ``begin_put`` has reserved pages (its ``copy_in``). Adds the stream the copy went to
    to ``streams``. Raises with nothing reserved and no copy left running."""
    e = tier._engine
    put_stream = tier._stream_for(src)
    shape = tuple(src.shape)
    used: list[_Stream] = []  # the stream the copy went to, once queued

    def copy(byte_runs: tuple[tuple[int, int], ...]) -> None:
        try:
            used.append(_queue_d2h(tier, src, byte_runs, put_stream, src_ready))
        except BaseException:  # the pages go back at once: no copy may still run into them
            _finish_all(src, put_stream)
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
                for stream in used:
                    if stream is not None:
                        stream.synchronize()
                e.return_landing(pages)
    stream = used[0] if used else None
    if stream is not None and not handle.exists_already:
        streams.setdefault((src.get_device(), _handle_of(stream)), stream)
    return handle


class _CallerStream:
    """The caller's current stream on CUDA device ``index``, by its raw handle
    (``kernels.current_raw_stream``; 0, the legacy default stream, is the current device's,
    so each call runs with ``index`` current)."""

    __slots__ = ("_rt", "handle", "index")

    def __init__(self, rt: CudaRuntime, index: int, handle: int) -> None:
        self._rt = rt
        self.index = index
        self.handle = handle

    def synchronize(self) -> None:
        with on_device(self.index):
            self._rt.stream_synchronize(self.handle)

    def record(self) -> StreamEvent:
        with on_device(self.index):
            return self._rt.event_after(self.handle)


_Stream = torch.cuda.Stream | _CallerStream | None  # None: a CPU copy, done already


def _handle_of(stream: torch.cuda.Stream | _CallerStream) -> int:
    return stream.handle if isinstance(stream, _CallerStream) else int(stream.cuda_stream)


def _record(
    tier: DeviceTier, stream: torch.cuda.Stream | _CallerStream
) -> torch.cuda.Event | StreamEvent:
    """An event that fires once the copies queued on ``stream`` so far are done."""
    if isinstance(stream, _CallerStream):
        return stream.record()
    event = tier._record(stream)
    assert event is not None, "a put stream is a CUDA stream"
    return event


def _finish_all(src: torch.Tensor, put_stream: torch.cuda.Stream | None) -> None:
    """After a failed copy call: wait for both streams a copy of ``src`` may be on."""
    if put_stream is not None:
        put_stream.synchronize()
        torch.cuda.current_stream(src.get_device()).synchronize()


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
    put_stream: torch.cuda.Stream | None,
    src_ready: bool,
) -> _Stream:
    """Queue the copy of contiguous ``src`` into the host byte runs (filled in order) and
    return the stream it went to (None: a CPU tensor, copied at once).

    Runs of copy-engine size go straight to the copy engine (``queue_to_host_runs``, whose
    checks hold here: a put waits for its copy, so the host time before it counts): on the
    caller's current stream, in order after its work (no query, no cross-stream wait), or,
    for ``src_ready``, on the put stream. The legacy default stream takes no batched call,
    so many runs from there go to the put stream after it. Small runs, or a backend forced
    in the settings, take ``transfer_ranges``' general path on the put stream."""
    total = sum(n for _, n in byte_runs)
    if not total:
        return None
    host = tier._engine.host_pool
    big = len(byte_runs) == 1 or total >= len(byte_runs) * tier._config.copy_engine_from_bytes
    engine_copy = tier._engine.settings.copy_backend == "auto" and big  # the copy engine's
    direct = engine_copy and put_stream is not None and host.registered  # without checks
    if direct and not src_ready:
        index = src.get_device()
        raw = kernels.current_raw_stream(index)
        if raw != 0 or len(byte_runs) <= MEMCPY_MAX_RUNS:
            rt = _cudart.runtime()
            assert rt is not None
            # What copy_to_host_runs would check holds here: src is contiguous on this
            # device (checked before), the pool registered through the CUDA runtime, and the
            # runs are the allocator's, adding up to src's bytes (sized from its shape).
            kernels.queue_to_host_runs(src, host.tensor.data_ptr(), byte_runs, raw)
            return _CallerStream(rt, index, raw)
    if put_stream is not None and not src_ready:
        # A producer may still be writing src on its stream: the copy waits for that
        # stream's work, unless it has none left (a query costs less than a wait).
        index = src.get_device()
        if not kernels.current_stream_idle(index):
            put_stream.wait_stream(torch.cuda.current_stream(index))
    if engine_copy:
        if direct:
            assert put_stream is not None
            kernels.queue_to_host_runs(src, host.tensor.data_ptr(), byte_runs, put_stream)
            return put_stream
        kernels.copy_to_host_runs(
            src, host.tensor, list(byte_runs), stream=put_stream, host_registered=host.registered
        )
        return put_stream
    flat = src.reshape(-1).view(torch.uint8)
    row = row_bytes_for(flat.data_ptr(), total, *(off for off, _ in byte_runs))
    lengths = np.array([n for _, n in byte_runs], dtype=np.int64)
    dst_rows = np.array([off for off, _ in byte_runs], dtype=np.int64) // row
    src_rows = (np.cumsum(lengths) - lengths) // row
    tier._transfer(
        flat.view(-1, row),
        host.tensor.view(-1, row),
        src_rows,
        dst_rows,
        lengths // row,
        put_stream,
    )
    return put_stream
