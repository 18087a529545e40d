# GENERATED from clients/_async/client.py by scripts/unasync.py: do not edit.
# Change the asyncio source, then run `python scripts/unasync.py`.
"""The client's public face: it owns a connection (``connection.py``), what the client
learned of its daemon (``state.py``) and the parts that do the work (puts, gets, the
stateless calls), and hands each call to its part; the parts never call back up.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Self, overload

import torch

from embcache.clients._backends.sync_io import leased_call
from embcache.clients._sync.connection import SPIN_US, Connection
from embcache.clients._sync.device_gets import DeviceGets
from embcache.clients._sync.device_puts import DevicePuts
from embcache.clients._sync.host_gets import HostGets
from embcache.clients._sync.host_puts import HostPuts
from embcache.clients._sync.results import LeasedTensors
from embcache.clients._sync.state import ClientState
from embcache.clients._sync.stateless_calls import StatelessCalls
from embcache.clients._sync.table_gets import TableReads
from embcache.clients._sync.view_holds import ViewHolds
from embcache.clients.core.replies import EntryBytes
from embcache.clients.core.requests import as_keys, get_request
from embcache.clients.device import into
from embcache.clients.device import puts as dp
from embcache.clients.device.host_replies import Pinned, pinned
from embcache.clients.device.read_table import COPY_GETS_UP_TO


class EmbCacheClient:
    """A client of one embcache daemon, for asyncio programs (docs/grpc.md).

    Made on the event loop that uses it. ``async with AsyncEmbCacheClient(target) as c:``
    closes it at the end; ``get`` is awaited, or used as ``async with c.get(keys) as ts:``.
    Every call raises ``RpcFailed`` when the daemon could not be reached (after the
    retries) in time.
    """

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        timeout: float = 30.0,
        retries: int = 5,
        root_certificates: bytes | None = None,
        tls: bool = False,
        private_key: bytes | None = None,
        certificate_chain: bytes | None = None,
        client_name: str | None = None,
        options: Sequence[tuple[str, Any]] = (),
        session_socket: bool = True,
        session_lane: bool | None = None,
        spin_us: int = SPIN_US,
        copy_gets_up_to: int = COPY_GETS_UP_TO,
    ) -> None:
        """Prepare a client of the daemon at ``target``; nothing is sent until the first call.

        Args:
            target: ``unix:/path``, a bare absolute path (a Unix socket), or ``host:port``.
            token: the daemon's bearer token, when it has one (default: the
                ``EMBCACHE_AUTH_TOKEN`` environment variable, as the CLI reads it; ``""``:
                none).
            timeout: the deadline of every call, in seconds.
            retries: how many times a call is tried again while the daemon is UNAVAILABLE.
            root_certificates: PEM roots for TLS (implies ``tls``).
            tls: connect over TLS with the system's roots.
            private_key, certificate_chain: a client certificate (PEM), for a daemon that
                verifies one (mTLS; implies ``tls``).
            client_name: shown by the daemon for this client's session (default:
                ``<program>:<pid>``, e.g. ``encode.py:12345``).
            options: extra gRPC channel options, after embcache's own.
            session_socket: use the daemon's session socket when it has one (False: always
                a gRPC Session stream); ``session_lane`` is its former name.
            spin_us: the blocking client polls the Unix session socket without sleeping
                for up to this long before it sleeps (0: never; docs/grpc.md).
            copy_gets_up_to: on the daemon's node, host entries of at most this many bytes
                come back as copies this process owns (out of the read table with no call
                where it has them, docs/same_node_reads.md); larger ones are views of the
                pool with a lease; 0: always views. Other machines get copies anyway.
        """
        self._conn = Connection(
            target,
            token=token,
            timeout=timeout,
            retries=retries,
            root_certificates=root_certificates,
            tls=tls,
            private_key=private_key,
            certificate_chain=certificate_chain,
            client_name=client_name,
            options=options,
            session_socket=session_socket if session_lane is None else session_lane,
            spin_us=spin_us,
        )
        self.target = self._conn.target
        self._state = ClientState(copy_gets_up_to=max(0, int(copy_gets_up_to)))
        self._tables = TableReads(self._conn, self._state)
        self._calls = StatelessCalls(self._conn, self._tables)
        self._host_puts = HostPuts(self._conn, self._state, self._tables)
        self._device_puts = DevicePuts(self._conn, self._state)
        holds = ViewHolds(self._conn)
        self._host_gets = HostGets(self._conn, self._state, self._tables, holds, self._calls)
        self._device_gets = DeviceGets(self._conn, self._state, self._tables, holds)

    @property
    def timeout(self) -> float:
        """The deadline of every call, in seconds."""
        return self._conn.timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        self._conn.timeout = value

    @property
    def retries(self) -> int:
        """How many times a call is tried again while the daemon is UNAVAILABLE."""
        return self._conn.retries

    @retries.setter
    def retries(self, value: int) -> None:
        self._conn.retries = value

    @overload
    def exists(self, keys: str) -> bool: ...  # type: ignore[overload-overlap]
    @overload
    def exists(self, keys: Sequence[str]) -> list[bool]: ...
    def exists(self, keys: str | Sequence[str]) -> bool | list[bool]:
        """Whether entries are stored (``AsyncStatelessCalls.exists``)."""
        return self._calls.exists(keys)

    @overload
    def evict(self, keys: str, device: Any = None) -> str: ...  # type: ignore[overload-overlap]
    @overload
    def evict(self, keys: Sequence[str], device: Any = None) -> list[str]: ...
    def evict(self, keys: str | Sequence[str], device: Any = None) -> str | list[str]:
        """Remove entries; leased ones are never forced out (``AsyncStatelessCalls.evict``)."""
        return self._calls.evict(keys, device)

    def prefetch(self, keys: Sequence[str], device: Any = None) -> dict[str, int]:
        """Warm the daemon's local tiers ahead of gets (``AsyncStatelessCalls.prefetch``)."""
        return self._calls.prefetch(keys, device)

    def stats(self) -> dict[str, Any]:
        """The daemon's stats document and its open sessions (``AsyncStatelessCalls.stats``)."""
        return self._calls.stats()

    def renew(self, lease_ids: Sequence[int], ttl_s: float | None = None) -> int:
        """Extend leases (``AsyncStatelessCalls.renew``)."""
        return self._calls.renew(lease_ids, ttl_s)

    def get_bytes(self, key: str, offset: int = 0, length: int | None = None) -> EntryBytes | None:
        """An entry's bytes, from any machine (``AsyncStatelessCalls.get_bytes``)."""
        return self._calls.get_bytes(key, offset, length)

    def put(self, key: str, tensor: Any, *, checksum: bool = True) -> bool:
        """Store a tensor under ``key``.

        A CUDA tensor is copied by the daemon from this GPU (``PutFromDevice``; no checksum:
        the bytes never pass through this process) when the daemon can open its memory;
        anything else goes by the cheapest host path the daemon serves (``host_puts.py``:
        inline on the session, written into reserved pages, or streamed in 1 MiB chunks).
        Puts are idempotent: retried like reads.

        Args:
            key: the entry's key.
            tensor: a torch tensor (any device) or a numpy array.
            checksum: send the CRC32 of streamed bytes for the daemon to check.

        Returns:
            True if the entry was created, False if it existed (same dtype and shape).

        Raises:
            MetadataConflict: the key exists with another dtype or shape.
            InvalidArgument: a bad key, dtype or shape, or bytes that fail their checksum.
            PoolExhausted: no room even after eviction (also QuotaExceeded, EntryTooLarge).
        """
        if self._state.caps.device_puts and dp.wants_device_put(tensor):
            created = self._device_puts.put(key, tensor)
            if created is not None:
                return created
        return self._host_puts.put_host(key, tensor, checksum)

    def put_many(
        self, items: Mapping[str, Any] | Sequence[tuple[str, Any]], *, checksum: bool = True
    ) -> list[bool]:
        """Store several tensors: the CUDA ones in ``PutFromDeviceBatch`` calls (one wait
        per call; each call is all or nothing), small host ones in ``put_batch`` session
        calls (up to 1 MiB each, all or nothing), the rest one by one as :meth:`put` does.

        Args:
            items: a mapping of keys to tensors, or ``(key, tensor)`` pairs.
            checksum: as for :meth:`put`.

        Returns:
            Per item, in order, True if it was created.

        Raises:
            ValueError: a key that is not a string, or one given twice.
            MetadataConflict: as for :meth:`put` (and its other errors).
        """
        pairs = dp.as_pairs(items)
        out: list[bool | None] = [None] * len(pairs)
        caps = self._state.caps
        cuda = [(i, k, t) for i, (k, t) in enumerate(pairs) if dp.wants_device_put(t)]
        if cuda and caps.device_puts and caps.batch_puts:
            self._device_puts.put_batches(cuda, out)
        for i, (k, t) in enumerate(pairs):  # CUDA tensors not batched: one device put each
            if out[i] is None and caps.device_puts and dp.wants_device_put(t):
                out[i] = self.put(k, t, checksum=checksum)
        rest = [i for i, c in enumerate(out) if c is None]
        stored = self._host_puts.put_host_many([pairs[i] for i in rest], checksum)
        for i, created in zip(rest, stored, strict=True):
            out[i] = created
        return [bool(c) for c in out]

    @leased_call
    def get(
        self,
        keys: str | Sequence[str],
        device: str | torch.device | None = None,
        *,
        ttl_s: float | None = None,
        zero_copy: bool = False,
    ) -> LeasedTensors:
        """Tensors for ``keys`` (None for a miss), valid for as long as you hold them.

        On the daemon's node the tensors are copies this process owns, read out of its
        host pool with no call where its read table has them (docs/same_node_reads.md);
        entries past ``copy_gets_up_to``, and all with ``zero_copy=True``, are views of the
        pool in private copy-on-write mappings (a write changes only your tensor).
        Elsewhere the bytes are streamed. With a CUDA ``device`` and a device pool on that
        GPU they are copies out of the pool into memory you own (one gather on the current
        stream), or with ``zero_copy=True`` views of the pool itself, read-only by contract;
        without such a pool they are copied there. A view's lease ends once its block has
        ended *and* its last tensor is gone (``AsyncLeasedTensors``); a copy's with the block.

        Args:
            keys: one key, or several.
            device: ``"cuda"``, ``"cuda:N"`` or a torch.device to get the tensors on a GPU;
                None or ``"cpu"`` for the host.
            ttl_s: the leases' lifetime between renewals (None: the daemon's default).
            zero_copy: views of the pool (the device pool's, with a CUDA ``device``) with
                a lease, instead of copies.

        Returns:
            The leased tensors, in the order of ``keys``; the asyncio client returns them
            from an awaitable that is also an async context manager.

        Raises:
            InvalidArgument: a bad key, or a lifetime the daemon refuses.
            RpcFailed: the daemon could not be reached (after the retries) in time, or the
                client is closed (code ``CANCELLED``).
        """
        names, _ = as_keys(keys)
        if device is not None and torch.device(device).type == "cuda":
            leased = self._device_gets.get(names, device, ttl_s, zero_copy)
            if leased is not None:
                return leased
        return self._host_gets.get(names, device, ttl_s, zero_copy)

    def pin(self, keys: Sequence[str], *, ttl_s: float | None = None) -> list[Pinned | None]:
        """Lease entries and learn each one's dtype and shape, without their bytes.

        One host ``Get`` whose locations are not mapped nor fetched: it works the same
        whether or not this process can map the daemon's pool. The leases keep the entries
        from eviction until :meth:`release` (``[p.lease_id for p in pins if p]``) or the
        end of their lifetime (``ttl_s``); they are not renewed by the client.

        Args:
            keys: the keys to pin.
            ttl_s: the leases' lifetime (None: the daemon's default).

        Returns:
            Per key, in order, a ``Pinned`` or None for a miss.

        Raises:
            InvalidArgument: a bad key, or a lifetime the daemon refuses.
        """
        names, _ = as_keys(keys)
        return pinned(self._conn.get_call(get_request(names, ttl_s)))

    def describe(self, keys: Sequence[str]) -> list[Pinned | None]:
        """Each entry's dtype, shape and size, without its bytes and without holding it.

        On the daemon's node this reads the daemon's read table with no call, when it lists
        every key; otherwise it is one ``pin`` whose leases end at once. Nothing keeps the
        entries from eviction afterwards: a later get may miss.

        Args:
            keys: the keys to describe.

        Returns:
            Per key, in order, a ``Pinned`` with ``lease_id`` 0, or None for a miss.

        Raises:
            InvalidArgument: a bad key.
        """
        return self._tables.describe(as_keys(keys)[0])

    def describe_listed(self, keys: Sequence[str]) -> list[Pinned | None] | None:
        """What the daemon's read table lists of ``keys`` right now, with no call at all.

        Never waits on the daemon nor on another thread's call through this client, so a
        loop that must not stall (a scheduler) may ask it inline. A table is read only once
        a session is open; until then, and where none can be read, this is None. Nothing is
        held: a listed entry may be evicted right after.

        Args:
            keys: the keys to look up.

        Returns:
            None where no table can be read now; else per key, in order, a ``Pinned`` with
            ``lease_id`` 0, or None where the table does not list the key (which says
            nothing of the daemon: it may hold the entry all the same).

        Raises:
            InvalidArgument: a bad key.
        """
        return self._tables.describe_listed(as_keys(keys)[0])

    @overload
    def get_into(
        self, keys: Sequence[str], out: torch.Tensor, offsets: Sequence[int] | None = None
    ) -> list[into.IntoResult]: ...
    @overload
    def get_into(self, keys: Sequence[str], out: Sequence[torch.Tensor]) -> list[bool]: ...
    def get_into(
        self,
        keys: Sequence[str],
        out: torch.Tensor | Sequence[torch.Tensor],
        offsets: Sequence[int] | None = None,
    ) -> list[into.IntoResult] | list[bool]:
        """Copy entries into your memory; the copies are complete when this returns.

        Args:
            keys: the entries, in order.
            out: one contiguous tensor (on a CUDA buffer the daemon copies straight into
                it), or a list of tensors: one per key, of its dtype and element count.
            offsets: with one tensor, each entry's byte offset in it; None packs the entries
                back to back at 16-byte-aligned offsets.

        Returns:
            With one tensor, an ``IntoResult`` per key (found, dtype, shape, nbytes, offset;
            ``r.view(out)`` is the entry over the buffer); with a list, found flags.

        Raises:
            ValueError: ``out`` or ``offsets`` cannot hold the entries (not contiguous,
                overlapping or too small slots, a dtype or size that differs).
        """
        names, _ = as_keys(keys)
        if not isinstance(out, torch.Tensor):
            outs = out
            if outs and all(isinstance(t, torch.Tensor) and t.is_cuda for t in outs):
                found = self._tables.into_cuda(names, outs)
                if found is not None:
                    return found
            return self._host_gets.copy(names, lambda ts: into.copy_into(ts, outs))
        into.check_buffer(out, names, offsets)
        if out.device.type == "cuda" and out.numel():
            results = self._device_gets.get_into(names, out, offsets)
            if results is not None:
                return results
        buffer = out
        return self._host_gets.copy(
            names, lambda ts: into.copy_into_buffer(names, ts, buffer, offsets)
        )

    def release(self, lease_ids: Sequence[int]) -> int:
        """End leases (the leased tensors of ``get`` do it when their block ends).

        Args:
            lease_ids: the ids of leases this client holds (``leased.lease_ids``).

        Returns:
            How many leases the daemon ended; fewer than given means some had ended
            already (expired, released, or their session ended).

        """
        return self._conn.release(lease_ids)

    def close(self) -> None:
        """Refuse new calls (those that need a session raise ``RpcFailed``, code
        ``CANCELLED``), then end the session (the daemon releases its leases) and close the
        channel: at once, or, while tensors of views are still held, once the last of them
        is gone (the pump does it then), so that they keep their bytes."""
        self._host_puts.close()
        self._conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
