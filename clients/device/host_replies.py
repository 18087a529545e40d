"""Get replies with host locations turned into tensors over the mapped host pool.

A same-node client maps the host pool once (``shm.PoolMaps``); an entry stored as one run
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


@dataclass(slots=True)
class Decoded:
    tensors: list[torch.Tensor | None]
    lease_ids: list[int]
    # Indexes of hits whose pool this process cannot map: fetch their bytes instead.
    remote: list[int] = field(default_factory=list)
    # Per lease id, the anchor its views keep alive (None: a copy the caller owns).
    anchors: list[Any] = field(default_factory=list)
    ready: Any = None  # device gets: an event recorded after the copies into owned memory


def decode_get(reply: pb.GetResponse, maps: PoolMaps, *, views: bool = True) -> Decoded:
    """Tensors for a host Get. ``views=False``: entries in one run are slices of the shared
    read-only mapping instead of private views (for the client's own copies, read once
    while the lease is held and never handed out: no mapping to make, no page to fault)."""
    pools = {p.pool_id: p for p in reply.pools}
    out = Decoded([], [])
    for index, result in enumerate(reply.results):
        if not result.found:
            out.tensors.append(None)
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
