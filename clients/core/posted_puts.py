"""Which stashed puts a client may commit with a posted message (no answer awaited).

The daemon answers a posted ``stash_commit`` only when it fails, and the put has returned by
then; so the client posts only commits the daemon cannot refuse for the request itself
(docs/same_node_reads.md, "Commits posted, not waited for").
"""

from __future__ import annotations

from collections.abc import Sequence

from embcache.clients.core.payload import Payload
from embcache.clients.device.stash import Carved
from embcache.proto.dtypes import lookup
from embcache.proto.embcache.v1 import embcache_pb2 as pb


def postable(
    items: Sequence[tuple[str, Payload]], carved: Sequence[Carved], bounds: pb.PostedCommits
) -> bool:
    """Whether a commit of ``items`` may be posted: all carved from one stash, and each
    within what the daemon checks (``bounds``), so that it cannot be refused for the
    request itself (a key stored meanwhile with another dtype or shape still can be: the
    daemon answers that failure, which the session logs)."""
    if len({place.stash_id for place in carved}) != 1:
        return False
    if sum(payload.nbytes for _, payload in items) > bounds.max_commit_bytes:
        return False
    for key, payload in items:
        if payload.nbytes > bounds.max_entry_bytes or len(payload.shape) > bounds.max_ndim:
            return False
        if not key or "\x00" in key or lookup(payload.dtype) is None:
            return False
        try:
            if len(key.encode("utf-8")) > bounds.max_key_bytes:
                return False
        except UnicodeEncodeError:
            return False
    return True
