"""Host views in private copy-on-write mappings (clients/device/shm.py, host_replies.py): a
write into one changes only that tensor, never the segment nor another view of the same
bytes; each view's mapping is the anchor its lease waits for; where no mapping can be made
the entry is copied."""

from __future__ import annotations

import fcntl
import gc
import mmap
import os
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

from embcache.clients.device import shm
from embcache.clients.device.host_replies import decode_get
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.proto.locations import boot_id

PAGE = 4096
SIZE = 16 * PAGE


@pytest.fixture
def segment(tmp_path: Path) -> tuple[Path, pb.PoolHandle]:
    path = tmp_path / "seg"
    data = np.arange(SIZE, dtype=np.uint32).astype(np.uint8)  # byte i holds i % 256
    path.write_bytes(data.tobytes())
    st = path.stat()
    desc = pb.HostShmPool(
        segment_name="seg", size=SIZE, page_bytes=PAGE, boot_id=boot_id(),
        st_dev=st.st_dev, st_ino=st.st_ino,
    )  # fmt: skip
    return path, pb.PoolHandle(pool_id="p", host_shm=desc)


def reply_of(runs: list[list[tuple[int, int]]]) -> pb.GetResponse:
    results = []
    for i, rs in enumerate(runs):
        n = sum(length for _, length in rs)
        host = pb.HostLocation(pool_id="p", runs=[pb.ByteRun(offset=o, length=k) for o, k in rs])
        meta = pb.TensorMeta(dtype="uint8", shape=[n], nbytes=n)
        results.append(pb.GetResult(key=f"k{i}", found=True, meta=meta, lease_id=i + 1, host=host))
    return pb.GetResponse(results=results)


def expected(offset: int, length: int) -> torch.Tensor:
    return torch.arange(offset, offset + length, dtype=torch.int64).remainder(256).to(torch.uint8)


def test_a_write_into_a_view_stays_in_that_view(segment) -> None:  # type: ignore[no-untyped-def]
    path, handle = segment
    maps = shm.PoolMaps(path.parent)
    mapping = maps.get(handle)
    assert mapping is not None
    a, anchor_a = mapping.private_view(2 * PAGE, PAGE)  # type: ignore[misc]
    b, _ = mapping.private_view(2 * PAGE, PAGE)  # type: ignore[misc]
    a.mul_(2)  # no fault: the mapping is writable, privately
    assert torch.equal(a, expected(2 * PAGE, PAGE) * 2)
    assert torch.equal(b, expected(2 * PAGE, PAGE))  # another view of the same bytes
    assert path.read_bytes()[2 * PAGE : 3 * PAGE] == expected(2 * PAGE, PAGE).numpy().tobytes()
    assert shm.mapped_segment(a, path.parent) == "seg"
    assert shm.mapped_segment(torch.zeros(4), path.parent) is None
    gone: list[int] = []
    weakref.finalize(anchor_a, gone.append, 1)
    del anchor_a
    rest = a[100:].view(torch.int32)  # what is made from a view keeps its mapping
    del a
    gc.collect()
    assert gone == [] and int(rest[0]) != 0
    del rest
    gc.collect()
    assert gone == [1]


def test_views_at_offsets_off_the_allocation_grain(segment) -> None:  # type: ignore[no-untyped-def]
    path, handle = segment
    mapping = shm.PoolMaps(path.parent).get(handle)
    assert mapping is not None
    got = mapping.private_view(PAGE + 100, 3000)
    assert got is not None and torch.equal(got[0], expected(PAGE + 100, 3000))
    for bad in ((SIZE - 10, 20), (-1, 10), (0, 0)):
        assert mapping.private_view(*bad) is None


def test_decode_gives_views_copies_and_gathers(segment, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    path, handle = segment
    maps = shm.PoolMaps(path.parent)
    reply = reply_of([[(0, 5000)], [(PAGE, 100), (8 * PAGE, 200)]])
    reply.pools.append(handle)
    decoded = decode_get(reply, maps)
    one, two = decoded.tensors
    assert decoded.lease_ids == [1, 2] and decoded.anchors[1] is None  # gathered: no anchor
    assert isinstance(decoded.anchors[0], mmap.mmap)
    assert shm.mapped_segment(one, path.parent) == "seg"
    assert torch.equal(one, expected(0, 5000))
    assert torch.equal(two, torch.cat([expected(PAGE, 100), expected(8 * PAGE, 200)]))
    one.fill_(0)  # the segment keeps its bytes
    assert path.read_bytes()[:4] == bytes([0, 1, 2, 3])

    def no_more_maps(*args: object, **kw: object) -> mmap.mmap:
        raise OSError(12, "Cannot allocate memory")  # vm.max_map_count reached, say

    monkeypatch.setattr(shm.mmap, "mmap", no_more_maps)
    again = decode_get(reply, maps)  # the whole-segment mapping is cached: only views fail
    assert again.anchors == [None, None]
    assert shm.mapped_segment(again.tensors[0], path.parent) is None
    assert torch.equal(again.tensors[0], expected(0, 5000))  # a copy instead of a view


def test_the_segment_stays_read_only_and_its_fd_closes_with_the_mapping(segment) -> None:  # type: ignore[no-untyped-def]
    path, handle = segment
    maps = shm.PoolMaps(path.parent)
    mapping = maps.get(handle)
    assert mapping is not None
    fd = mapping.fd
    assert os.fstat(fd).st_ino == path.stat().st_ino
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    assert flags & os.O_ACCMODE == os.O_RDONLY  # private mappings never write the file
    del mapping
    maps._forget("seg")
    gc.collect()
    with pytest.raises(OSError):
        os.fstat(fd)
