"""Same-node reads into GPU memory with no call: copies out of this process's own mapping of
the daemon's host pool, checked against the read table once they are complete.

The host pool's segment is mapped here already (``shm.py``); registered with CUDA
(``registered.py``, in chunks, in the background after the first use) the GPU copies from it
at link speed. A batch is served here only when the table has every key and every run is
registered; otherwise nothing is handed out and the caller asks the daemon. The order that
makes it safe (docs/same_node_reads.md, "Reads to a GPU"):

1. locate every key (its slot's sequence number, meta and runs);
2. queue the copies on the caller's stream (device to device where the table offers a
   copy of the entry in a device pool on that GPU, ``table_device.py``; else out of the
   registered host mapping), then wait for an event recorded after them;
3. check every slot again: all unchanged means each copy is its entry, whole (the daemon
   bumps a slot before its pages can be reused, and a copy that completed before the check
   read nothing written after it). Anything else: the copies are discarded.

The wait in 2 comes before any answer, success or not: a copy still running must never race
the daemon's own copy into the same buffer when the caller falls back to a call.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from embcache.clients.device.into import IntoResult, pack_offsets
from embcache.clients.device.read_table import Located, ReadTable


def to_cuda(
    table: ReadTable, keys: Sequence[str], device: torch.device
) -> list[torch.Tensor] | None:
    """``get(keys, device=<cuda>)`` served here: new tensors on ``device``, or None."""
    located = locate_all(table, keys)
    if located is None:
        return None
    outs = [torch.empty(entry.nbytes, dtype=torch.uint8, device=device) for entry in located]
    with torch.cuda.device(device):
        if not copy_located(table, located, outs):
            return None
    return [out.view(e.dtype).view(e.shape) for out, e in zip(outs, located, strict=True)]


def into_cuda_buffer(
    table: ReadTable, keys: Sequence[str], out: torch.Tensor, offsets: Sequence[int] | None
) -> list[IntoResult] | None:
    """``get_into(keys, out, offsets)`` into one CUDA buffer served here, or None (also when
    the entries do not fit: the daemon's answer then says why)."""
    located = locate_all(table, keys)
    if located is None:
        return None
    slots = list(offsets) if offsets is not None else pack_offsets([e.nbytes for e in located])
    flat = as_bytes(out)
    spans = sorted((o, o + e.nbytes) for o, e in zip(slots, located, strict=True) if e.nbytes)
    if any(b[0] < a[1] for a, b in itertools.pairwise(spans)):
        return None
    if spans and spans[-1][1] > flat.numel():
        return None
    outs = [flat[o : o + e.nbytes] for o, e in zip(slots, located, strict=True)]
    with torch.cuda.device(out.device):
        if not copy_located(table, located, outs):
            return None
    return [
        IntoResult(key, True, e.dtype_name, e.shape, e.nbytes, o)
        for key, e, o in zip(keys, located, slots, strict=True)
    ]


def into_cuda_tensors(
    table: ReadTable, keys: Sequence[str], outs: Sequence[torch.Tensor]
) -> list[bool] | None:
    """``get_into(keys, [tensors])`` served here when every tensor is a contiguous CUDA
    tensor of its entry's dtype and size, on one device; None otherwise."""
    located = locate_all(table, keys)
    if located is None or not outs or len(outs) != len(located):
        return None
    device = outs[0].device
    for entry, out in zip(located, outs, strict=True):
        if (
            out.device != device
            or not out.is_contiguous()
            or out.dtype != entry.dtype
            or out.numel() * out.element_size() != entry.nbytes
        ):
            return None  # the daemon's path names what is wrong
    with torch.cuda.device(device):
        if not copy_located(table, located, [as_bytes(o) for o in outs]):
            return None
    return [True] * len(located)


def locate_all(table: ReadTable, keys: Sequence[str]) -> list[Located] | None:
    """Every key's place in the table, or None if any one is not there (ask the daemon)."""
    found = []
    for key in keys:
        located = table.locate(key)
        if located is None:
            return None
        found.append(located)
    return found


def copy_located(
    table: ReadTable, located: Sequence[Located], outs: Sequence[torch.Tensor]
) -> bool:
    """Copy each entry into its ``out`` (a contiguous CUDA tensor of its bytes, all on one
    device) on that device's current stream, wait until the copies are complete, and check
    the table. True: every ``out`` holds its entry. False: use none of them (some run was not
    registered yet, a pool could not be used, or an entry changed meanwhile)."""
    if not located:
        return True
    from embcache.clients.device.registered import registered_pool
    from embcache.clients.device.table_cuda import copy_runs_to_cuda
    from embcache.clients.device.table_device import copy_from_device_pool, placement_on

    device = outs[0].device
    registration = registered_pool(table.pool)  # starts registering on first use
    stream = torch.cuda.current_stream(device)
    queued = False
    served = True
    for entry, out in zip(located, outs, strict=True):
        if not entry.nbytes:
            continue
        # A copy in a device pool on this GPU: device to device; else from the host pool.
        placement = placement_on(entry, table.device_pools, device)
        if placement is not None:
            event = copy_from_device_pool(entry, placement, table.device_pools, out, stream)
            if event is not None:
                queued = True
                continue
        if registration is None or not registration.usable:
            served = False
            break
        if copy_runs_to_cuda(table.pool, registration, entry.runs, out, stream) is None:
            served = False
            break
        queued = True
    if queued:  # complete before anything is said, even a fallback (module docstring)
        done = torch.cuda.Event()
        done.record(stream)
        done.synchronize()
    return served and all(table.unchanged(entry) for entry in located)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, as a flat uint8 view."""
    return tensor.reshape(-1).view(torch.uint8)
