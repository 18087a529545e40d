"""Host gets whose small entries come back as copies: their bytes follow the result raw.

A same-node host get hands out a view of the pool under a lease: the client maps the run
privately, tracks the view, and releases the lease once the view is gone. For a small entry
that work costs far more than its bytes: copying 64 KiB takes microseconds, the view's path
about 150 us of Python on both ends. So where the session runs on a session socket and the
request says ``inline_max_bytes``, entries of at most that size (and at most ``INLINE_TOTAL``
bytes per reply) are copied out of the pool while their lease lives, the lease ends at once,
and the copies follow the result (``GetResult.inline``; ``GetResponse.inline_bytes`` says how
many bytes follow). Nothing stays leased for them, so nothing waits on the client: a client
that dies between the result and its bytes leaves no lease behind. Larger entries, and those
past the budget, are leased and located as in any other get.

The copy is made when the connection has room for the reply (``calls.SessionCalls``), so a
client that sends gets and reads nothing holds no copies beyond the one reply being sent.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from embcache.errors import UnknownSession
from embcache.proto.constants import INLINE_TOTAL
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.service.engine import CacheEngine
from embcache.service.host.leases import Lease
from embcache.service.transport.session.bytes_out import DRAIN_S, BytesReply, view_of

ALIGN = 16  # each copy's offset in the raw bytes is a multiple of this

# (keys, leases) -> the reply locating the leased entries; raises ReplyTooLarge when too large
Render = Callable[[Sequence[str], Sequence[Lease | None]], pb.GetResponse]


def inline_get(
    engine: CacheEngine,
    request: pb.GetRequest,
    owner: str,
    *,
    alive: Callable[[str], bool],
    render: Render,
) -> tuple[pb.GetResponse, BytesReply | None]:
    """The reply to a host get of ``owner`` and the copies to send after it (None: none).
    Entries copied are found, with ``lease_id`` 0 and an ``inline`` location; the leases of
    the rest belong to ``owner``, as in a plain get. On any error no lease is left.

    Raises:
        InvalidArgument: a bad lease lifetime (the engine's checks).
        UnknownSession: ``owner``'s session ended meanwhile.
        ReplyTooLarge: the located results do not fit one message (``render``).
    """
    ttl = request.ttl_s if request.HasField("ttl_s") else None
    keys = list(request.keys)
    leases = engine.get(keys, owner, ttl_s=ttl)
    held = [x.lease_id for x in leases if x is not None]
    try:
        if not alive(owner):  # leases taken after the session ended would outlive it
            raise UnknownSession("session ended during the call", session=owner)
        picks, offsets, total = [], [], 0
        for i, lease in enumerate(leases):
            if lease is not None and lease.nbytes <= request.inline_max_bytes:
                start = -total % ALIGN + total  # each copy 16-byte aligned: any dtype views it
                if start + lease.nbytes <= INLINE_TOTAL:
                    picks.append(i)
                    offsets.append(start)
                    total = start + lease.nbytes
        payload = bytearray(total)
        with memoryview(payload) as into:  # a memoryview's slice takes a view by memcpy
            for i, offset in zip(picks, offsets, strict=True):
                lease, pos = leases[i], offset
                assert lease is not None
                # One view per run, copied while the lease lives (iter_bytes checks it).
                chunks = engine.iter_bytes(lease, 0, None, max(lease.nbytes, 1), copy=view_of)
                for view in chunks:
                    into[pos : pos + len(view)] = view
                    pos += len(view)
        copied = [leases[i] for i in picks]
        rest = list(leases)
        for i in picks:
            rest[i] = None
        reply = render(keys, rest)
        for i, lease, offset in zip(picks, copied, offsets, strict=True):
            assert lease is not None
            result = reply.results[i]
            result.found = True
            result.meta.CopyFrom(pb.TensorMeta(dtype=lease.dtype, shape=lease.shape,
                                               nbytes=lease.nbytes))  # fmt: skip
            result.inline.offset = offset
        reply.inline_bytes = total
        # From here on only the located entries' leases are held (the caller's to give back).
        held = [x.lease_id for x in rest if x is not None]
        engine.release((x.lease_id for x in copied if x is not None), owner)
    except BaseException:
        engine.release(held, owner)
        raise
    if not total:
        return reply, None
    deadline = time.monotonic() + DRAIN_S  # a copy: no lease limits how long it may wait
    out = pb.BytesOut(payload_bytes=total)
    return reply, BytesReply(out, [memoryview(payload)], _nothing, deadline)


def _nothing() -> None:
    """A copy's release: it holds no lease."""
