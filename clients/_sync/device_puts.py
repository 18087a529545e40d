# GENERATED from clients/_async/device_puts.py by scripts/unasync.py: do not edit.
# Change the asyncio source, then run `python scripts/unasync.py`.
"""Puts of CUDA tensors that the daemon copies straight from this GPU (``PutFromDevice``,
batched as ``PutFromDeviceBatch``): the bytes never pass through this process.

Where the daemon cannot open this GPU's memory, or lacks the batched call, the client
remembers it (``core/capabilities.py``) and puts such tensors as host bytes from then on.
"""

from __future__ import annotations

import torch

from embcache.clients._sync.connection import Connection
from embcache.clients._sync.device_calls import device_call, when_unavailable
from embcache.clients._sync.state import ClientState
from embcache.clients.device import exports
from embcache.clients.device import puts as dp
from embcache.proto.embcache.v1 import embcache_pb2 as pb


class DevicePuts:
    """A client's puts that the daemon copies from this GPU."""

    def __init__(self, conn: Connection, state: ClientState) -> None:
        self._conn = conn
        self._state = state

    def put(self, key: str, tensor: torch.Tensor) -> bool | None:
        """Store a CUDA tensor by the daemon's copy; True if created, None: put it as
        host bytes instead (its memory cannot be exported, or the daemon cannot read it)."""
        exported = exports.export_cuda(tensor.detach().contiguous())
        if exported is None:
            return None
        request = pb.PutFromDeviceRequest(key=key, tensor=exported.message)
        fallback = when_unavailable(self._state.caps.put_failed)  # streams from now on
        reply = device_call(
            self._conn, "put_from_device", request, self._conn.stub.PutFromDevice, fallback
        )
        if reply is None:
            return None
        exported.returned()  # the daemon has copied: its event may be reused
        return bool(reply.created)

    def put_batches(
        self, cuda: list[tuple[int, str, torch.Tensor]], out: list[bool | None]
    ) -> None:
        """Store the CUDA tensors ``(slot, key, tensor)`` in ``PutFromDeviceBatch`` calls,
        each all or nothing, filling ``out[slot]``; stops at the first batch the daemon
        refused (the rest go one by one)."""
        for batch in dp.batches(cuda) or []:
            reply = device_call(
                self._conn,
                "put_from_device_batch",
                batch.request,
                self._conn.stub.PutFromDeviceBatch,
                self._state.caps.put_failed,
            )
            if reply is None:
                break
            batch.returned(reply, out)
