"""Puts from device memory: reserve host pages, queue each copy as early as it can go,
then commit the batch, all or nothing.

:func:`start_puts` queues each item's device -> host copy into pages from the prealloc
before the item is checked and recorded, else as soon as ``PutPath.begin`` has reserved its
pages (the copy engine moves one tensor while the next is reserved), then records one event
per stream. The caller waits its own way (an event loop polls ``done()``, a thread calls
``wait()``); ``finish()`` checks the checksums and commits the batch, ``abort()`` gives the
pages back once the copies that write them are complete. The source tensors must stay
readable until either returns. Nothing of the batch is visible before ``finish()``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from embcache.errors import InvalidArgument
from embcache.kernels import StreamEvent
from embcache.service.device import puts
from embcache.service.device.puts import CallerStream, Stream
from embcache.service.device.tier import DeviceTier
from embcache.service.host.put_writer import PutHandle

Runs = tuple[tuple[int, int], ...]
CopyIn = Callable[[Runs], None]


class PutTarget(Protocol):
    """The calls a batch of device puts makes (``put_path.PutPath``'s)."""

    def take_prealloc(self, key: str, nbytes: int, copy_in: CopyIn) -> Runs | None: ...

    def give_back_prealloc(self, pages: Runs) -> None: ...

    def top_up_prealloc(self) -> None: ...

    def begin(  # called with the arguments below only
        self, key: str, dtype: str, shape: Sequence[int], *, owner: str, checksum: int | None,
        copy_in: CopyIn | None = None, pages: Runs | None = None,
    ) -> PutHandle: ...  # fmt: skip


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
        """Block until every copy has completed."""
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
                seconds = time.perf_counter() - self._start
                self._tier.copier.observe("d2h", self.loaded_bytes, seconds)
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
    target: PutTarget,
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
    may still be writing its tensor there). ``src_ready``: the caller knows every tensor is
    written already (the daemon waited for the client's event), so the copies follow
    nothing."""
    if len(items) > 1 and len({key for key, _ in items}) != len(items):
        raise InvalidArgument("a key appears more than once in the batch")
    if checksums is None:
        checksums = [None] * len(items)
    elif len(checksums) != len(items):
        raise InvalidArgument("one checksum per item", items=len(items), checksums=len(checksums))
    dtypes = [puts.source_dtype(src) for _, src in items]
    start = time.perf_counter()
    # what the copies were queued on, by (device, stream handle)
    streams: dict[tuple[int, int], torch.cuda.Stream | CallerStream] = {}
    nbytes = 0
    with contextlib.ExitStack() as stack:  # aborts every put reserved so far if we raise
        handles = []
        try:
            for (key, src), dtype, crc in zip(items, dtypes, checksums, strict=True):
                handle = _begin(target, tier, key, src, dtype, owner, crc, streams, src_ready)
                stack.enter_context(handle)
                handles.append(handle)
                target.top_up_prealloc()  # for the next put, while this copy runs
                if handle.exists_already:
                    handle.skip_bytes()
                    continue
                nbytes += handle.nbytes
            for handle in handles:  # while the copies run: what a first get needs planned
                if not handle.exists_already:
                    tier.prepare(handle.entry)
            tier.copier.count("d2h", nbytes)  # counted as queued, in the copies' shadow
            events = [puts.record(stream) for stream in streams.values()]
        except BaseException:
            for stream in streams.values():  # freed pages must not still be copied into
                stream.synchronize()
            raise
        return PendingPut(tier, handles, stack.pop_all(), events, nbytes, start)


def _begin(
    target: PutTarget,
    tier: DeviceTier,
    key: str,
    src: torch.Tensor,
    dtype: str,
    owner: str,
    crc: int | None,
    streams: dict[tuple[int, int], torch.cuda.Stream | CallerStream],
    src_ready: bool,
) -> PutHandle:
    """Begin the put of ``src`` with its copy queued as early as it can be: into pages
    from the prealloc before anything else, else the moment ``begin_put`` has reserved
    pages (its ``copy_in``). Adds the stream the copy went to to ``streams``. Raises with
    nothing reserved and no copy left running."""
    put_stream = tier.copier.stream_for(src)
    shape = tuple(src.shape)
    used: list[Stream] = []  # the stream the copy went to, once queued

    def copy(byte_runs: Runs) -> None:
        try:
            used.append(puts.queue_d2h(tier.copier, src, byte_runs, put_stream, src_ready))
        except BaseException:  # the pages go back at once: no copy may still run into them
            puts.finish_all(src, put_stream)
            raise

    pages = target.take_prealloc(key, src.numel() * src.element_size(), copy)
    if pages is None:
        handle = target.begin(key, dtype, shape, owner=owner, checksum=crc, copy_in=copy)
    else:
        adopted = False
        try:  # checked and recorded while the copy engine works
            handle = target.begin(key, dtype, shape, owner=owner, checksum=crc, pages=pages)
            adopted = not handle.exists_already  # else stored meanwhile by another put
        finally:
            if not adopted:  # the pages go back once the copy into them is done
                for stream in used:
                    if stream is not None:
                        stream.synchronize()
                target.give_back_prealloc(pages)
    stream = used[0] if used else None
    if stream is not None and not handle.exists_already:
        streams.setdefault((src.get_device(), puts.handle_of(stream)), stream)
    return handle
