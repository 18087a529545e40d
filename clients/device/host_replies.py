"""Get replies with host locations turned into tensors over the mapped host pool.

Small entries may come as copies instead, their bytes after the result (the daemon's
``session/inline_gets.py``): tensors over those bytes, with no lease. A same-node client
maps the host pool once (``shm.PoolMaps``); an entry stored as one run
becomes a zero-copy view in a private copy-on-write mapping of its own (writes stay in this
process), an entry spread over several runs is gathered into a new tensor. A view's mapping
is its anchor: its lease ends once its block has ended and the anchor is gone
(``core/views.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from embcache.clients.device.shm import PoolMapping, PoolMaps
from embcache.proto.dtypes import torch_dtype
from embcache.proto.embcache.v1 import embcache_pb2 as pb

# Host entries up to this size are asked for as copies sent after the result where the
# client copies them anyway (get_into a host buffer): below it the copy costs less than a
# mapping and a lease. A client on another machine asks for copies of up to the most the
# daemon sends in one reply (1 MiB); larger entries are fetched by get_bytes.
INLINE_GET_BYTES = 256 << 10
INLINE_REMOTE_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class Pinned:
    """An entry leased by ``pin``: what it holds, not its bytes."""

    key: str
    dtype: str  # as torch names it ("bfloat16")
    shape: tuple[int, ...]
    nbytes: int
    lease_id: int


def pinned(reply: pb.GetResponse) -> list[Pinned | None]:
    """Each result of a host Get as a ``Pinned`` (None for a miss); nothing is mapped."""
    return [
        Pinned(r.key, r.meta.dtype, tuple(int(d) for d in r.meta.shape), r.meta.nbytes, r.lease_id)
        if r.found and r.lease_id
        else None
        for r in reply.results
    ]


def leased_ids(reply: pb.GetResponse) -> list[int]:
    """The leases a host Get handed out (entries sent as copies have none)."""
    return [r.lease_id for r in reply.results if r.found and r.lease_id]


@dataclass(slots=True)
class Decoded:
    tensors: list[torch.Tensor | None]
    lease_ids: list[int]
    # Indexes of hits whose pool this process cannot map: fetch their bytes instead.
    remote: list[int] = field(default_factory=list)
    # Per lease id, the anchor its views keep alive (None: a copy the caller owns).
    anchors: list[Any] = field(default_factory=list)
    ready: Any = None  # device gets: an event recorded after the copies into owned memory


def decode_get(
    reply: pb.GetResponse,
    maps: PoolMaps,
    *,
    views: bool = True,
    payload: bytearray | None = None,
) -> Decoded:
    """Tensors for a host Get. ``views=False``: entries in one run are slices of the shared
    read-only mapping instead of private views (for the client's own copies, read once
    while the lease is held and never handed out: no mapping to make, no page to fault).
    ``payload``: the raw bytes after the result, of the entries it sent as copies (no lease;
    their tensors are over it, owned by the caller)."""
    pools = {p.pool_id: p for p in reply.pools}
    out = Decoded([], [])
    if len(payload or b"") != reply.inline_bytes:
        raise ValueError("get: the raw bytes after the result are not as many as it says")
    for index, result in enumerate(reply.results):
        if not result.found:
            out.tensors.append(None)
            continue
        if result.WhichOneof("location") == "inline":
            out.tensors.append(_copied(result, payload or bytearray()))
            continue
        out.lease_ids.append(result.lease_id)
        if result.WhichOneof("location") != "host" or result.host.pool_id not in pools:
            raise ValueError(f"reply for {result.key!r} names no host pool this client knows")
        mapping = maps.get(pools[result.host.pool_id])
        if mapping is None:
            out.tensors.append(None)
            out.anchors.append(None)
            out.remote.append(index)
            continue
        tensor, anchor = _tensor(result, mapping, views)
        out.tensors.append(tensor)
        out.anchors.append(anchor)
    return out


def _copied(result: pb.GetResult, payload: bytearray) -> torch.Tensor:
    """An entry the daemon sent as a copy: a tensor over its bytes in ``payload``."""
    meta, offset = result.meta, result.inline.offset
    if offset + meta.nbytes > len(payload):
        raise ValueError(f"reply for {result.key!r} has inline bytes past the payload")
    if meta.nbytes:
        flat = torch.frombuffer(payload, dtype=torch.uint8, count=meta.nbytes, offset=offset)
    else:
        flat = torch.empty(0, dtype=torch.uint8)
    return flat.view(torch_dtype(meta.dtype)).view(tuple(meta.shape))


def _tensor(result: pb.GetResult, mapping: PoolMapping, views: bool) -> tuple[torch.Tensor, Any]:
    """The entry of ``result``, and the anchor of its view (None for a copy or a slice)."""
    meta, pool = result.meta, mapping.tensor
    runs = [(r.offset, r.length) for r in result.host.runs]
    if sum(n for _, n in runs) != meta.nbytes or any(o + n > pool.numel() for o, n in runs):
        raise ValueError(f"reply for {result.key!r} has byte runs outside the pool")
    anchor = None
    if len(runs) == 1 and not views:  # read-only memory: the caller copies it at once
        offset, length = runs[0]
        flat = pool[offset : offset + length]
    elif len(runs) == 1 and (view := mapping.private_view(*runs[0])) is not None:
        flat, anchor = view
    elif len(runs) == 1:  # no mapping could be made: a copy of the run
        offset, length = runs[0]
        flat = torch.from_numpy(pool[offset : offset + length].numpy().copy())
    else:  # several runs (or none, for an empty tensor): gather into fresh memory
        # numpy copies each run with one memcpy; torch's copy_ of 64 KiB or more splits it
        # over its intra-op threads, whose wake-up costs more than the copy (~130 us).
        flat = torch.empty(meta.nbytes, dtype=torch.uint8)
        out, src = flat.numpy(), pool.numpy()
        pos = 0
        for offset, length in runs:
            out[pos : pos + length] = src[offset : offset + length]
            pos += length
    return flat.view(torch_dtype(meta.dtype)).view(tuple(meta.shape)), anchor
