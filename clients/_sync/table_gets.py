# GENERATED from clients/_async/table_gets.py by scripts/unasync.py: do not edit.
# Change the asyncio source, then run `python scripts/unasync.py`.
"""Same-node reads out of the daemon's read table (``device/read_table.py``), with no call.

On the daemon's node a get, ``exists`` or ``describe`` of entries the table lists is read
straight out of the daemon's pool; the hits are then posted to the daemon on the session,
so that its stats and LRU see them. Where the table cannot be read (another machine, no
table, the session gone) each answers None and the caller asks the daemon.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, overload

import torch

from embcache.clients._sync.connection import Connection
from embcache.clients._sync.state import ClientState
from embcache.clients.core.requests import get_request
from embcache.clients.core.session_calls import SessionLost
from embcache.clients.device import table_reads
from embcache.clients.device.host_replies import Pinned, pinned
from embcache.clients.device.into import IntoResult
from embcache.clients.device.read_table import ReadTable
from embcache.proto.embcache.v1 import embcache_pb2 as pb


class TableReads:
    """The read table of one client's session, and the reads out of it."""

    def __init__(self, conn: Connection, state: ClientState) -> None:
        self._conn = conn
        self._state = state

    def read_table(self) -> ReadTable | None:
        """The daemon's read table, mapped, where this process may copy from it; None
        where it cannot (another machine, no table, the session gone)."""
        if self._state.pool_local is False or not self._state.copy_gets_up_to:
            return None
        session = self._conn.open_session()
        if not session.alive:
            return None
        return self._state.tables.get(session.read_table, self._state.maps)

    def table_now(self, lookups: bool = False) -> ReadTable | None:
        """The read table of the session already open, with no call and no wait on the
        session's lock (another thread may be in a call on this client); None where there is
        none right now (no session yet, one that ended, another machine, no table), or
        where gets do not copy from it (``copy_gets_up_to`` 0) unless only for ``lookups``."""
        session = self._conn.session
        if self._state.pool_local is False or not (lookups or self._state.copy_gets_up_to):
            return None
        # A put's lookups come right after it opened (and so checked) the session: no
        # second look at the socket.
        if session is None or not (lookups or session.alive):
            return None
        return self._state.tables.get(session.read_table, self._state.maps)

    def copies(self, names: list[str]) -> list[Any] | None:
        """Copies of every key's entry out of the daemon's read table, with no call (the hits
        are posted to the daemon, which counts them), or None where any one is not readable
        so, or the session is gone: ask the daemon then."""
        table = self.read_table()
        if table is None:
            return None
        copies = table.read_all(names, self._state.copy_gets_up_to)
        if copies is None or not self.touched(names):
            return None
        return copies

    def to_cuda(self, names: list[str], device: torch.device) -> list[Any] | None:
        """``get(names, device)`` copied out of the pool this process maps, with no call
        (``device/table_reads.py``), or None: ask the daemon."""
        table = self.read_table()
        if table is None:
            return None
        copies = table_reads.to_cuda(table, names, device)
        if copies is None or not self.touched(names):
            return None
        return copies

    @overload
    def into_cuda(
        self, names: list[str], out: torch.Tensor, offsets: Sequence[int] | None
    ) -> list[IntoResult] | None: ...
    @overload
    def into_cuda(self, names: list[str], out: Sequence[torch.Tensor]) -> list[bool] | None: ...
    def into_cuda(
        self,
        names: list[str],
        out: torch.Tensor | Sequence[torch.Tensor],
        offsets: Sequence[int] | None = None,
    ) -> list[IntoResult] | list[bool] | None:
        """``get_into`` a CUDA buffer, or CUDA tensors, with no call, or None."""
        table = self.read_table()
        if table is None:
            return None
        if isinstance(out, torch.Tensor):
            found: list[IntoResult] | list[bool] | None
            found = table_reads.into_cuda_buffer(table, names, out, offsets)
        else:
            found = table_reads.into_cuda_tensors(table, names, out)
        if found is None or not self.touched(names):
            return None
        return found

    def touched(self, names: list[str]) -> bool:
        """Post the hits of a table read to the daemon (its stats and LRU see them at once);
        False when the session is gone: the daemon went, and the call path says so."""
        session = self._conn.open_session()
        try:  # sent now, not with the next call
            session.post(now=True, touch=pb.TouchRequest(keys=names))
        except SessionLost:
            return False
        return True

    def describe(self, names: list[str]) -> list[Pinned | None]:
        """Each entry's dtype, shape and size (``describe``): out of the read table where it
        lists every key, else one pin whose leases end at once."""
        table = self.read_table()
        if table is not None:
            found = [table.locate(k) for k in names]
            if all(f is not None and table.unchanged(f) for f in found):
                return [
                    Pinned(k, f.dtype_name, f.shape, f.nbytes, 0)
                    for k, f in zip(names, found, strict=True)
                    if f is not None
                ]
        pins = pinned(self._conn.get_call(get_request(names, None)))
        ids = [p.lease_id for p in pins if p is not None]
        if ids:
            self._conn.release(ids)
        return [None if p is None else dataclasses.replace(p, lease_id=0) for p in pins]

    def describe_listed(self, names: list[str]) -> list[Pinned | None] | None:
        """What the read table lists of ``names`` now, with no call (``describe_listed``)."""
        table = self.table_now()
        if table is None:
            return None
        out: list[Pinned | None] = []
        for key in names:
            f = table.locate(key)
            listed = f is not None and table.unchanged(f)
            out.append(Pinned(key, f.dtype_name, f.shape, f.nbytes, 0) if listed and f else None)
        return out
