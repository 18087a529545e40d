"""The copy of a put from device memory into its host pages, queued without waiting.

A put follows the work its producer queued on the caller's current stream: the copy is
queued on that stream itself when the copy engine takes it straight (no query, no
cross-stream wait), else on the device's put stream after it. The caller (the engine's
device puts) records an event per stream and waits its own way.
"""

from __future__ import annotations

import numpy as np
import torch

from embcache import kernels
from embcache.errors import InvalidArgument
from embcache.kernels import CudaRuntime, StreamEvent, on_device
from embcache.kernels.host_runs import MEMCPY_MAX_RUNS
from embcache.proto.dtypes import from_torch
from embcache.service.device.copier import Copier
from embcache.service.device.copy_plan import row_bytes_for


class CallerStream:
    """The caller's current stream on CUDA device ``index``, by its raw handle
    (``kernels.current_raw_stream``; 0, the legacy default stream, is the current device's,
    so each call runs with ``index`` current)."""

    __slots__ = ("_rt", "handle", "index")

    def __init__(self, rt: CudaRuntime, index: int, handle: int) -> None:
        self._rt = rt
        self.index = index
        self.handle = handle

    def synchronize(self) -> None:
        """Block until the work queued on the stream so far is done."""
        with on_device(self.index):
            self._rt.stream_synchronize(self.handle)

    def record(self) -> StreamEvent:
        """An event after the work queued on the stream so far."""
        with on_device(self.index):
            return self._rt.event_after(self.handle)


Stream = torch.cuda.Stream | CallerStream | None  # None: a CPU copy, done already


def handle_of(stream: torch.cuda.Stream | CallerStream) -> int:
    """The raw CUDA stream handle, which tells two streams of a batch apart."""
    return stream.handle if isinstance(stream, CallerStream) else int(stream.cuda_stream)


def record(stream: torch.cuda.Stream | CallerStream) -> torch.cuda.Event | StreamEvent:
    """An event that fires once the copies queued on ``stream`` so far are done."""
    if isinstance(stream, CallerStream):
        return stream.record()
    event = torch.cuda.Event()
    event.record(stream)
    return event


def finish_all(src: torch.Tensor, put_stream: torch.cuda.Stream | None) -> None:
    """After a failed copy call: wait for both streams a copy of ``src`` may be on."""
    if put_stream is not None:
        put_stream.synchronize()
        torch.cuda.current_stream(src.get_device()).synchronize()


def source_dtype(src: torch.Tensor) -> str:
    """The dtype name of a tensor a put may copy from; InvalidArgument if it may not."""
    dt = from_torch(src.dtype)
    if dt is None:
        raise InvalidArgument("unsupported dtype", dtype=str(src.dtype))
    if not src.is_contiguous():
        raise InvalidArgument("source tensor must be contiguous")
    return dt.name


def queue_d2h(
    copier: Copier,
    src: torch.Tensor,
    byte_runs: tuple[tuple[int, int], ...],
    put_stream: torch.cuda.Stream | None,
    src_ready: bool,
) -> Stream:
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
    host = copier.host
    big = len(byte_runs) == 1 or total >= len(byte_runs) * copier.config.copy_engine_from_bytes
    engine_copy = copier.backend == "auto" and big  # the copy engine's
    direct = engine_copy and put_stream is not None and host.registered  # without checks
    if direct and not src_ready:
        index = src.get_device()
        raw = kernels.current_raw_stream(index)
        if raw != 0 or len(byte_runs) <= MEMCPY_MAX_RUNS:
            rt = kernels.cuda_runtime()
            assert rt is not None
            # What copy_to_host_runs would check holds here: src is contiguous on this
            # device (checked before), the pool registered through the CUDA runtime, and the
            # runs are the allocator's, adding up to src's bytes (sized from its shape).
            kernels.queue_to_host_runs(src, host.tensor.data_ptr(), byte_runs, raw)
            return CallerStream(rt, index, raw)
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
    copier.transfer(
        flat.view(-1, row),
        host.tensor.view(-1, row),
        src_rows,
        dst_rows,
        lengths // row,
        put_stream,
    )
    return put_stream
