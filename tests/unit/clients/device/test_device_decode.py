"""Device get replies into tensors (clients/device/device_replies.py), on a CPU stand-in for
a device pool: by default every entry is copied into memory the caller owns (contiguous ones
on page boundaries join the gather, others are copied alone); with ``owned=False`` the
contiguous ones are anchored views of the pool and the fragmented ones still gathered."""

from __future__ import annotations

import torch

from embcache.clients.device import device_replies as dr
from embcache.clients.device.anchors import Anchor
from embcache.proto.embcache.v1 import embcache_pb2 as pb

PAGE = 1024
POOL = 16 * PAGE


class Pools:
    def __init__(self) -> None:
        self.pool = torch.arange(POOL, dtype=torch.int64).remainder(251).to(torch.uint8)

    def pool_tensor(self, handle: object, size: int) -> torch.Tensor:
        return self.pool[:size]


def reply(*placements: tuple[str, int | list[int], int]) -> pb.GetResponse:
    out = pb.GetResponse()
    for i, (kind, where, nbytes) in enumerate(placements):
        loc = pb.DeviceLocation(pool_id="d", gpu_uuid="CPU-0")
        if kind == "offset":
            assert isinstance(where, int)
            loc.offset = where
        else:
            assert isinstance(where, list)
            loc.pages.page_ids.extend(where)
        meta = pb.TensorMeta(dtype="uint8", shape=[nbytes], nbytes=nbytes)
        out.results.append(
            pb.GetResult(key=f"k{i}", found=True, meta=meta, lease_id=i + 1, device=loc)
        )
    out.results.append(pb.GetResult(key="miss", found=False))
    pool = pb.DevicePool(gpu_uuid="CPU-0", size=POOL, page_bytes=PAGE)
    out.pools.append(pb.PoolHandle(pool_id="d", device=pool))
    return out


def test_owned_copies_by_default() -> None:
    pools = Pools()
    got = dr.decode_device_get(
        reply(("offset", 2 * PAGE, 1500), ("offset", 5 * PAGE + 8, 100), ("pages", [9, 3], 1800)),
        pools,  # type: ignore[arg-type]
    )
    a, b, c, miss = got.tensors
    assert miss is None and got.lease_ids == [1, 2, 3] and got.anchors == [None] * 3
    src = pools.pool
    assert torch.equal(a, src[2 * PAGE : 2 * PAGE + 1500])  # joined the gather
    assert torch.equal(b, src[5 * PAGE + 8 : 5 * PAGE + 108])  # not on a page: copied alone
    assert torch.equal(c, torch.cat([src[9 * PAGE : 10 * PAGE], src[3 * PAGE : 3 * PAGE + 776]]))
    lo, hi = src.data_ptr(), src.data_ptr() + POOL
    assert not any(lo <= t.data_ptr() < hi for t in (a, b, c))  # none is a view of the pool
    a.fill_(0)
    b.fill_(0)
    assert int(src[2 * PAGE + 1]) != 0 and int(src[5 * PAGE + 9]) != 0  # the pool is untouched
    assert got.ready is None  # no GPU: the copies are complete already


def test_zero_copy_views_have_anchors_of_their_own() -> None:
    pools = Pools()
    got = dr.decode_device_get(
        reply(("offset", 2 * PAGE, 1500), ("pages", [9, 3], 1800), ("offset", 0, 0)),
        pools,  # type: ignore[arg-type]
        owned=False,
    )
    a, c, empty, _ = got.tensors
    anchor, none, none_too = got.anchors
    assert isinstance(anchor, Anchor) and none is None and none_too is None
    assert a.data_ptr() == pools.pool.data_ptr() + 2 * PAGE  # a view of the pool itself
    assert a.untyped_storage().data_ptr() != pools.pool.untyped_storage().data_ptr()
    assert not (pools.pool.data_ptr() <= c.data_ptr() < pools.pool.data_ptr() + POOL)
    assert empty.numel() == 0
