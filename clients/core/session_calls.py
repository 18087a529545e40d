"""Calls carried on a session, whichever its transport (gRPC stream or session socket).

The daemon says when it opens a session whether it runs calls there, and which; each call has
a client-chosen id, and its result wakes the caller waiting on that id. A result that arrives
after its caller gave up (deadline) hands out leases nobody holds: they are released.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any, Protocol

from embcache.clients.core.errors import RpcFailed
from embcache.proto.dtypes import lookup
from embcache.proto.embcache.v1 import embcache_pb2 as pb

log = logging.getLogger("embcache.client")

# How long the daemon's copies for a call should take, for the blocking client's spin: the
# bytes of the client's tensors at a conservative 10 GB/s (the copies run at 20-55), at most
# 2 ms. A result that comes after the spin costs the sleeping reader a wake-up (tens of
# microseconds) on top.
SPIN_COPY_BYTES_PER_S = 10e9
MAX_EXPECTED_S = 2e-3


class SessionLost(RpcFailed):
    """The Session stream ended before a call's result came back (its leases, if any, ended
    with it)."""

    def __init__(self, message: str = "the Session stream ended during the call") -> None:
        super().__init__(message, "UNAVAILABLE")


class CallCarrier(Protocol):
    """What :func:`serves` reads: a session of either transport (gRPC stream or session socket)."""

    serves_calls: bool
    serves_device_puts: bool
    serves_host_puts: bool
    serves_stash_puts: bool


def serves(session: CallCarrier, kind: str) -> bool:
    """Whether the daemon behind ``session`` runs calls of ``kind`` on the stream."""
    if not session.serves_calls:
        return False
    if kind in ("put_from_device", "put_from_device_batch"):
        return session.serves_device_puts
    if kind in ("put", "put_batch"):
        return getattr(session, "serves_host_puts", False)
    if kind in ("stash_refill", "stash_commit", "put_abort"):
        return getattr(session, "serves_stash_puts", False)
    if kind == "get_bytes":
        return getattr(session, "serves_bytes_out", False)
    if kind == "get_into":
        return getattr(session, "serves_get_into", False)
    if kind == "inline_get":  # a host get whose small entries follow its result as copies
        return getattr(session, "serves_inline_gets", False)
    return True


def unclaimed_release(result: pb.SessionResult) -> pb.SessionRequest | None:
    """For a result whose caller gave up (deadline): the call that releases the leases it
    hands out, if any (either transport, sync or asyncio)."""
    if result.WhichOneof("outcome") != "get":
        return None
    ids = [r.lease_id for r in result.get.results if r.found and r.lease_id]
    if not ids:
        return None
    return pb.SessionRequest(call=pb.SessionCall(release=pb.ReleaseRequest(lease_ids=ids)))


def note_posted_failure(result: pb.SessionResult) -> None:
    """Log a posted stash commit's failure (a result with call id 0: its put had already
    returned; the daemon applied none of the commit's entries)."""
    if result.call_id == 0 and result.WhichOneof("outcome") == "error":
        error = result.error
        log.warning("a posted put was refused by the daemon: %s: %s", error.code, error.message)


def expected_work_s(request: Mapping[str, Any]) -> float:
    """How long the daemon's copies for a session call (``{kind: message}``) should take:
    those of a GetInto's destination buffer and of a device put's tensors; 0 for the rest."""
    nbytes = 0
    if (into := request.get("get_into")) is not None:
        nbytes = _tensor_bytes(into.destination.buffer)
    elif (put := request.get("put_from_device")) is not None:
        nbytes = _tensor_bytes(put.tensor)
    elif (batch := request.get("put_from_device_batch")) is not None:
        nbytes = sum(_tensor_bytes(item.tensor) for item in batch.items)
    return min(nbytes / SPIN_COPY_BYTES_PER_S, MAX_EXPECTED_S)


def _tensor_bytes(t: pb.CudaIpcTensor) -> int:
    dtype = lookup(t.dtype)
    return dtype.itemsize * math.prod(t.shape) if dtype is not None else 0
