"""Inline puts framed by hand (proto/framing.py): the bytes protobuf would write."""

from __future__ import annotations

import numpy as np
import pytest

from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.proto.framing import FRAME_HEADER, InlinePuts, call_frame, call_message


def items(sizes: list[int]) -> list[tuple[pb.PutHeader, memoryview]]:
    out = []
    for i, n in enumerate(sizes):
        data = (np.arange(n) * 7 % 251).astype(np.uint8).data
        header = pb.PutHeader(key=f"k{i}", dtype="uint8", shape=[n], nbytes=n, checksum=i)
        out.append((header, data))
    return out


@pytest.mark.parametrize("sizes", [[0], [1], [127], [128], [70000], [0, 5, 300, 1 << 16, 3]])
@pytest.mark.parametrize("call_id", [1, 127, 128, 2**63 - 1])
def test_inline_puts_frame_as_protobuf_does(sizes: list[int], call_id: int) -> None:
    for batch in (True, False):
        puts = InlinePuts(items(sizes if batch else sizes[-1:]), batch)
        framed = puts.frame(call_id)
        want = pb.SessionRequest(
            call=pb.SessionCall(call_id=call_id, **{puts.kind: puts.message()})
        ).SerializeToString()
        assert FRAME_HEADER.unpack(framed[: FRAME_HEADER.size]) == (len(want),)
        assert framed[FRAME_HEADER.size :] == want
        assert call_frame(call_id, {puts.kind: puts}) == framed
        assert call_message(call_id, {puts.kind: puts}).SerializeToString() == want


def test_other_calls_go_through_protobuf() -> None:
    release = pb.ReleaseRequest(lease_ids=[3, 4])
    want = pb.SessionRequest(call=pb.SessionCall(call_id=9, release=release))
    framed = call_frame(9, {"release": release})
    assert framed[FRAME_HEADER.size :] == want.SerializeToString()
