"""Which stashed puts the client posts: only those the daemon cannot refuse as requests."""

from __future__ import annotations

import numpy as np

from embcache.clients.core.payload import Payload, payload_of
from embcache.clients.core.posted_puts import postable
from embcache.clients.device.stash import Carved
from embcache.proto.embcache.v1 import embcache_pb2 as pb

BOUNDS = pb.PostedCommits(max_key_bytes=8, max_entry_bytes=1024, max_commit_bytes=1536, max_ndim=3)


def item(key: str = "k", nbytes: int = 16, shape: tuple[int, ...] | None = None) -> tuple:
    payload = payload_of(np.zeros(nbytes, dtype=np.uint8))
    if shape is not None:
        payload = Payload(payload.dtype, shape, payload.data)
    return key, payload


def places(n: int, stashes: int = 1) -> list[Carved]:
    return [Carved(1 + i % stashes, ((i * 4096, 16),)) for i in range(n)]


def test_a_plain_put_is_posted() -> None:
    assert postable([item()], places(1), BOUNDS)
    assert postable([item("a" * 8), item("b", 1024)], places(2), BOUNDS)


def test_puts_the_daemon_would_refuse_are_not() -> None:
    assert not postable([item("a" * 9)], places(1), BOUNDS)  # key over max_key_bytes
    assert not postable([item("é" * 5)], places(1), BOUNDS)  # 10 UTF-8 bytes
    assert not postable([item("\ud800")], places(1), BOUNDS)  # not encodable
    assert not postable([item("")], places(1), BOUNDS)
    assert not postable([item("a\x00b")], places(1), BOUNDS)
    assert not postable([item(nbytes=1025)], places(1), BOUNDS)  # over max_entry_bytes
    assert not postable([item(shape=(1, 1, 1, 16))], places(1), BOUNDS)  # over max_ndim
    bad_dtype = ("k", Payload("complex64", (2,), memoryview(bytes(16))))
    assert not postable([bad_dtype], places(1), BOUNDS)


def test_a_commit_too_large_or_over_two_stashes_is_not() -> None:
    two = [item("a", 1024), item("b", 1024)]  # 2 KiB: over max_commit_bytes
    assert not postable(two, places(2), BOUNDS)
    assert not postable([item("a"), item("b")], places(2, stashes=2), BOUNDS)
