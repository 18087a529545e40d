"""Get replies with host locations turned into tensors over the mapped host pool.

A same-node client maps the host pool once (``shm.PoolMaps``); an entry stored as one run
becomes a zero-copy view of the pool, an entry spread over several runs is gathered into
a new tensor. Views stay valid while their lease lives.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from embcache.clients.device.shm import PoolMaps
from embcache.proto.dtypes import torch_dtype
from embcache.proto.embcache.v1 import embcache_pb2 as pb


@dataclass(slots=True)
class Decoded:
    tensors: list[torch.Tensor | None]
    lease_ids: list[int]
    # Indexes of hits whose pool this process cannot map: fetch their bytes instead.
    remote: list[int] = field(default_factory=list)


def decode_get(reply: pb.GetResponse, maps: PoolMaps) -> Decoded:
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
            out.remote.append(index)
            continue
        out.tensors.append(_tensor(result, mapping.tensor))
    return out


def _tensor(result: pb.GetResult, pool: torch.Tensor) -> torch.Tensor:
    meta = result.meta
    runs = [(r.offset, r.length) for r in result.host.runs]
    if sum(n for _, n in runs) != meta.nbytes or any(o + n > pool.numel() for o, n in runs):
        raise ValueError(f"reply for {result.key!r} has byte runs outside the pool")
    if len(runs) == 1:
        offset, length = runs[0]
        flat = pool[offset : offset + length]
    else:  # several runs (or none, for an empty tensor): gather into fresh memory
        flat = torch.empty(meta.nbytes, dtype=torch.uint8)
        pos = 0
        for offset, length in runs:
            flat[pos : pos + length].copy_(pool[offset : offset + length])
            pos += length
    return flat.view(torch_dtype(meta.dtype)).view(tuple(meta.shape))
