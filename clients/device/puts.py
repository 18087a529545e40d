"""Batched puts of same-node CUDA tensors (``PutFromDeviceBatch``).

``put_many`` sends every CUDA tensor the daemon can read in as few calls as possible (up to
:data:`MAX_ITEMS` items and about :data:`MAX_REQUEST_BYTES` of request per call); the daemon
copies them and waits once per call, and a call is all or nothing. Anything else (host
tensors, numpy arrays, tensors that cannot be exported) is streamed one by one, as ``put``
does.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from embcache.clients.device import exports
from embcache.proto.embcache.v1 import embcache_pb2 as pb

MAX_ITEMS = 1024  # the daemon's limit per call
MAX_REQUEST_BYTES = 1 << 20  # below the daemon's message limit (1 MiB chunk + 128 KiB)


def wants_device_put(tensor: Any) -> bool:
    """A non-empty CUDA tensor: a put tries the daemon's copy from this GPU first."""
    return isinstance(tensor, torch.Tensor) and tensor.is_cuda and tensor.numel() > 0


def as_pairs(items: Mapping[str, Any] | Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """``(key, tensor)`` pairs from a mapping or a sequence; ValueError on a repeated key."""
    pairs = list(items.items()) if isinstance(items, Mapping) else list(items)
    keys = [key for key, _ in pairs]
    if any(not isinstance(key, str) for key in keys):
        raise ValueError("items: keys must be strings")
    if len(set(keys)) != len(keys):
        raise ValueError("items: a key appears more than once")
    return pairs


@dataclass
class Batch:
    """One ``PutFromDeviceBatch`` request and the input positions of its items; ``keep``
    holds the exported tensors until the call returned."""

    positions: list[int]
    request: pb.PutFromDeviceBatchRequest
    keep: list[exports.Exported]

    def returned(self, reply: pb.PutFromDeviceBatchResponse, created: list[bool | None]) -> None:
        """The call succeeded: its events may be reused; each item's outcome goes to its
        input position in ``created``."""
        for e in self.keep:
            e.returned()
        for i, r in zip(self.positions, reply.results, strict=True):
            created[i] = r.created


def batches(items: Sequence[tuple[int, str, Any]]) -> list[Batch] | None:
    """The requests for ``(position, key, cuda tensor)`` items; None when a tensor cannot be
    exported (the caller streams them all instead). One interprocess event per GPU, recorded
    after every tensor was exported, covers all the writes of the tensors."""
    exported = []
    for _, _, tensor in items:
        e = exports.export_cuda(tensor.detach().contiguous(), event=False)
        if e is None:
            return None
        exported.append(e)
    out = list(_split(items, exported))
    for batch in out:
        by_device: dict[Any, list[exports.Exported]] = {}
        for e in batch.keep:
            by_device.setdefault(e.tensor.device, []).append(e)
        for device, group in by_device.items():
            exports.record_event(device, group)
        for item, e in zip(batch.request.items, batch.keep, strict=True):
            item.tensor.event_handle = e.message.event_handle
    return out


def _split(
    items: Sequence[tuple[int, str, Any]], exported: list[exports.Exported]
) -> Iterator[Batch]:
    batch = Batch([], pb.PutFromDeviceBatchRequest(), [])
    size = 0
    for (position, key, _), e in zip(items, exported, strict=True):
        item = pb.PutFromDeviceRequest(key=key, tensor=e.message)
        n = item.ByteSize() + 8 + 64  # the field's tag and length, the event handle to come
        if batch.positions and (len(batch.positions) >= MAX_ITEMS or size + n > MAX_REQUEST_BYTES):
            yield batch
            batch, size = Batch([], pb.PutFromDeviceBatchRequest(), []), 0
        batch.positions.append(position)
        batch.request.items.append(item)
        batch.keep.append(e)
        size += n
    if batch.positions:
        yield batch
