# GENERATED from clients/_async/connection.py by scripts/unasync.py: do not edit.
# Change the asyncio source, then run `python scripts/unasync.py`.
"""A client's connection to one daemon: the gRPC channel, the session, and the retries.

The session anchors the client's leases in the daemon: it is opened on first use and kept
for the life of the client, and when it ends (``close()``, this process dies, the connection
drops) the daemon releases them. It runs on the daemon's session socket when the target is a
Unix socket that has one, or a TCP target (without TLS) whose daemon says where its session
socket listens on TCP (the Lanes RPC), else on a gRPC Session stream. Each new session looks
for the socket again, also while it retries a restarting daemon, so a client that outlives a
daemon restart returns to it.

Every call gets the client's deadline and is retried on UNAVAILABLE with jittered
exponential backoff; a call that names a session the daemon forgot is tried again on a new
one.

Leases of zero-copy views end once their block has ended and their views are gone
(``core/views.py``); the connection's pump (a task, or a thread in the blocking client,
started with the first view) renews them until then and releases them afterwards, and the
next call on the session releases what it finds gone first.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Self, TypeVar, overload

import grpc
import torch

from embcache.clients._backends.sync_io import CallFn, Lock, Pump, connect, run_blocking, sleep
from embcache.clients._backends.sync_session import Session
from embcache.clients._backends.sync_uds import Address, UdsSession
from embcache.clients.core.capabilities import Capabilities, HostFallbacks
from embcache.clients.core.channel import auth_metadata
from embcache.clients.core.errors import RpcFailed, from_call_error, translate
from embcache.clients.core.identity import default_client_name, default_token
from embcache.clients.core.requests import renew_request
from embcache.clients.core.retry import backoff_s, is_unknown_session, retry_step, should_retry
from embcache.clients.core.session_calls import SessionLost, serves
from embcache.clients.core.targets import normalize_target, tcp_address, uds_path
from embcache.clients.core.views import BATCH, ViewLeases
from embcache.clients.device import table_reads
from embcache.clients.device.device_replies import sync_devices
from embcache.clients.device.host_replies import Decoded
from embcache.clients.device.into import IntoResult
from embcache.clients.device.pools import process_device_pools
from embcache.clients.device.read_table import COPY_GETS_UP_TO, ReadTable, process_read_tables
from embcache.clients.device.shm import process_pool_maps
from embcache.errors import EmbCacheError, QuotaExceeded
from embcache.proto.constants import SESSION_KEY
from embcache.proto.embcache.v1 import embcache_pb2 as pb

T = TypeVar("T")
log = logging.getLogger("embcache.client")


LINGER_S = 1.0  # how long the pump looks again for releases queued without a wake
TCP_CONNECT_S = 2.0  # at most this long to reach a session socket on TCP (else gRPC)
SPIN_US = 300  # the blocking client's spin before it sleeps on the session socket


class Connection:
    """The channel, session and retries of a client, and what it learned of its daemon."""

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
        session_lane: bool = True,
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
            session_lane: use the daemon's session socket when it has one (False: always
                a gRPC Session stream).
            spin_us: the blocking client waits for a result on the Unix session socket
                by polling it without sleeping for up to this long first (0: never), which
                spares the kernel's wake-up of a sleeping thread (docs/grpc.md); on TCP,
                and in the asyncio client, it waits without spinning.
            copy_gets_up_to: on the daemon's node, host entries of at most this many bytes
                come back as copies this process owns, read straight out of the daemon's
                pool with no call where its read table has them (docs/same_node_reads.md),
                else sent after the result; larger ones are views of the pool with a lease
                (as is every entry of a ``get(..., zero_copy=True)``); 0: always views.
                Clients on other machines get copies anyway.
        """
        target = normalize_target(target)
        self._channel, self._stub, self._put, self._get_bytes = connect(
            target,
            tls=tls,
            root_certificates=root_certificates,
            options=options,
            private_key=private_key,
            certificate_chain=certificate_chain,
        )
        self.target = target
        self._copy_gets_up_to = max(0, int(copy_gets_up_to))
        self.timeout = timeout
        self.retries = retries
        token = default_token(token)
        self._auth = auth_metadata(token)
        self._token = token
        # The daemon keeps 256 characters, and reads a first message of a few KiB only.
        self._client_name = default_client_name(client_name)[:256]
        self._uds = uds_path(target) if session_lane else None
        self._spin_s = max(spin_us, 0) / 1e6
        secure = tls or root_certificates is not None or private_key is not None
        # The session socket on TCP speaks no TLS: a client that asked for TLS never uses it.
        self._tcp_lane = session_lane and not secure and tcp_address(target, 0) is not None
        self._session: Session | UdsSession | None = None
        self._session_lock = Lock()
        self._closed = False
        self._maps = process_pool_maps()
        self._tables = process_read_tables()
        self._pool_local: bool | None = None  # whether this process maps the host pool
        self._device_pools = process_device_pools()
        self._no_device = HostFallbacks()  # GPUs served through the host for now
        self._caps = Capabilities()  # what the daemon turned out not to support
        self._views = ViewLeases()  # leases held until their block ends and views are gone
        self._pump = Pump(self._tend_views, "embcache-views")
        self._unsent_retry_at = 0.0  # releases waiting for a session: not tried before this
        self._unsent_failures = 0

    # -- the session -----------------------------------------------------------------------
    def _session_id(self) -> str:
        session = self._open_session()
        assert session.session_id is not None
        return session.session_id

    def _open_session(self) -> Session | UdsSession:
        with self._session_lock:
            if self._closed:
                raise RpcFailed("client is closed", "CANCELLED")
            return self._live_session(retry=True)

    def _live_session(self, *, retry: bool) -> Session | UdsSession:
        """Lock held: the session, or a new one if it ended (``retry``: with the retries of
        a call, else one short try); the releases that waited for a session go out first
        on a new one."""
        if self._session is None or not self._session.alive:
            if self._session is not None:
                self._session.close()  # ended: let go of its socket or reader
                self._session = None
            if retry:  # a retry (UNAVAILABLE: a restarting daemon) looks for the socket again
                self._session = self._call(self._uds_or_stream, tend=False)
            else:
                wait_s = min(self.timeout, TCP_CONNECT_S)
                self._session = self._uds_or_stream(self._auth, wait_s)
            self._post_unsent(self._session)
        return self._session

    def _post_unsent(self, session: Session | UdsSession) -> None:
        """Send on ``session`` the releases that found no live session (``core/views.py``):
        the daemon ends the holds it kept for this process's views (its quarantine) when
        they come from a session of the same process, and no one else's."""
        ids = self._views.take_unsent()
        if not ids or not serves(session, "release"):
            return  # (an old daemon: it kept no such holds)
        try:
            for i in range(0, len(ids), BATCH):
                session.post(now=True, release=pb.ReleaseRequest(lease_ids=ids[i : i + BATCH]))
        except SessionLost:
            self._views.keep_unsent(ids)  # the next session, then

    def _send_unsent(self) -> None:
        """The pump's part: releases wait and no session lives, so open one for them (one
        short try; if the daemon is away, again after a backoff of up to a minute)."""
        if time.monotonic() < self._unsent_retry_at:
            return
        try:
            with self._session_lock:
                self._live_session(retry=False)
            self._unsent_failures = 0
        except (EmbCacheError, grpc.RpcError, OSError, TimeoutError) as exc:
            log.debug("no session for the releases of views that are gone yet: %s", exc)
            self._unsent_retry_at = time.monotonic() + min(2.0**self._unsent_failures, 60.0)
            self._unsent_failures += 1

    def _uds_or_stream(self, metadata: Any, timeout: float) -> Session | UdsSession:
        """A session on the daemon's session socket if it has one, else a gRPC Session stream."""
        uds = self._open_uds(metadata, timeout)
        return uds or Session.open(self._stub, metadata, self._client_name, timeout)

    def _open_uds(self, metadata: Any, timeout: float) -> UdsSession | None:
        """A session on the daemon's session socket; None if it has none (this session uses
        gRPC; the next one looks for the socket again, e.g. after the daemon restarted)."""
        address = self._uds or self._tcp_lane_address(metadata, timeout)
        if address is None:
            return None
        tcp = isinstance(address, tuple)
        try:
            return UdsSession.open(
                address,
                self._token,
                self._client_name,
                min(self.timeout, TCP_CONNECT_S) if tcp else self.timeout,
                spin_s=0.0 if tcp else self._spin_s,  # a network's round trip: no spin
            )
        except (OSError, TimeoutError) as err:
            if tcp:  # unreachable (a firewall, another network): gRPC from now on
                self._tcp_lane = False
            log.debug("no session socket at %s (%s): this session uses gRPC", address, err)
            return None
        except QuotaExceeded as err:  # the socket is at its connection cap: gRPC this time
            log.info("session socket at %s is full (%s): this session uses gRPC", address, err)
            return None

    def _tcp_lane_address(self, metadata: Any, timeout: float) -> Address | None:
        """Where the daemon's session socket listens on TCP (the Lanes RPC), if it does."""
        if not self._tcp_lane:
            return None
        try:
            reply = self._stub.Lanes(pb.LanesRequest(), timeout=timeout, metadata=metadata)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise  # retried by the caller's loop (UNAVAILABLE) or translated
            self._tcp_lane = False  # an older daemon
            return None
        return tcp_address(self.target, reply.tcp_port) if reply.tcp_port else None

    def _drop_session(self) -> None:
        with self._session_lock:
            if self._session is not None:
                self._session.close()
                self._session = None

    # -- calls -----------------------------------------------------------------------------
    def _call(self, fn: CallFn[T], *, session: bool = False, tend: bool = True) -> T:
        """Run ``fn(metadata, timeout)`` with retries on UNAVAILABLE (and a stale session).
        ``tend``: first release the leases whose views are gone (not from the session's
        opening or a release itself, which that would re-enter)."""
        if tend and self._views.pending():
            self._release_gone()  # so that an evict, say, finds them released
        reopened = False
        attempt = 0
        while True:
            metadata = self._auth
            if session:
                metadata = (*metadata, (SESSION_KEY, self._session_id()))
            try:
                return fn(metadata, self.timeout)
            except grpc.RpcError as err:
                if session and not reopened and is_unknown_session(err):
                    reopened = True
                    self._drop_session()
                    continue
                if should_retry(err) and attempt < self.retries:
                    sleep(backoff_s(attempt))
                    attempt += 1
                    continue
                raise translate(err) from err

    def _session_call(
        self,
        kind: str,
        request: Any,
        rpc: CallFn[T],
        take: Callable[[Any, bytearray | None], T] | None = None,
    ) -> T:
        """``request`` as a ``kind`` call on the session when the daemon serves those there
        (cheaper than an RPC), else the RPC ``rpc(metadata, timeout)`` in the session.
        The answer is the result's ``kind`` reply, or ``take(reply, payload)`` of it and
        the raw bytes that followed (get_bytes'). Retried like an RPC: on UNAVAILABLE, and
        on a new session if the session ended (a Get's leases ended with it; a put is
        idempotent)."""
        attempt = 0
        while True:
            session = self._open_session()
            if not serves(session, kind):
                return self._call(rpc, session=True)  # releases what is gone first
            if self._views.pending():
                self._post_gone(session)  # rides in front of this call
            try:
                if take is None:  # no raw bytes follow this kind's result
                    result, payload = session.call(self.timeout, **{kind: request}), None
                else:
                    result, payload = session.call_with_payload(self.timeout, **{kind: request})
            except SessionLost:
                if attempt >= self.retries:
                    raise
                attempt += 1
                continue
            if result.WhichOneof("outcome") == kind:
                if take is not None:
                    return take(getattr(result, kind), payload)
                reply: T = getattr(result, kind)
                return reply
            if retry_step(result, attempt, self.retries) == "new_session":
                self._drop_session()  # the daemon forgot it: start a new one
            else:
                sleep(backoff_s(attempt))
            attempt += 1

    def _get_call(self, request: pb.GetRequest) -> pb.GetResponse:
        """A Get whose leases belong to this client's session (see :meth:`_session_call`)."""
        return self._session_call(
            "get", request, lambda md, to: self._stub.Get(request, timeout=to, metadata=md)
        )

    # -- leases and life cycle -------------------------------------------------------------
    def release(self, lease_ids: Sequence[int]) -> int:
        """End leases (the leased tensors of ``get`` do it when their block ends).

        Args:
            lease_ids: the ids of leases this client holds (``leased.lease_ids``).

        Returns:
            How many leases the daemon ended; fewer than given means some had ended
            already (expired, released, or their session ended).

        Raises:
            RpcFailed: the daemon could not be reached (after the retries) in time.
        """
        if not lease_ids:
            return 0
        request = pb.ReleaseRequest(lease_ids=lease_ids)
        # The session as it is: opening one here would wait on a daemon that is away (a
        # release from the views' pump); the next call opens it, and releases what went
        # meanwhile over it (``_post_gone``), ending what the daemon quarantined.
        session = self._session
        if session is not None and session.alive and session.serves_calls:
            try:
                result = session.call(self.timeout, release=request)
            except SessionLost:  # the session's leases ended with it; ask over an RPC
                pass
            else:
                if result.WhichOneof("outcome") == "release":
                    return int(result.release.released)
                raise from_call_error(result.error)
        # In the session while it lives (also after close(), until the views are gone): the
        # daemon releases only the caller's own leases.
        sid = session.session_id if session is not None and session.alive else None
        if not sid:
            # No live session: these leases ended with theirs. Those the daemon still holds
            # for this process's views end only through a session of this process: the
            # next one takes them (opened by the pump if nothing else opens one).
            self._views.keep_unsent(lease_ids)
            self._pump.poke()
            return 0
        metadata = ((SESSION_KEY, sid),)

        reply = self._call(
            lambda md, to: self._stub.Release(request, timeout=to, metadata=(*md, *metadata)),
            tend=False,
        )
        return int(reply.released)

    def close(self) -> None:
        """Refuse new calls (those that need a session raise ``RpcFailed``, code
        ``CANCELLED``), then end the session (the daemon releases its leases) and close the
        channel: at once, or, while tensors of views are still held, once the last of them
        is gone (the pump does it then), so that they keep their bytes."""
        if self._closed:
            return
        self._pump.stop()  # no round runs from here on
        self._closed = True
        self._release_gone()
        if self._views.unsent and not len(self._views):
            self._send_unsent()
        if len(self._views):
            log.debug("the session ends once its views are gone (%d left)", len(self._views))
            self._pump = Pump(self._tend_views, "embcache-views-closing")
            self._pump.poke()
            return
        self._shut()

    def _shut(self) -> None:
        self._drop_session()
        self._channel.close()

    # -- same-node reads (device/read_table.py) --------------------------------------------
    def _read_table(self) -> ReadTable | None:
        """The daemon's read table, mapped, where this process may copy from it; None
        where it cannot (another machine, no table, the session gone)."""
        if self._pool_local is False or not self._copy_gets_up_to:
            return None
        session = self._open_session()
        if not session.alive:
            return None
        return self._tables.get(session.read_table, self._maps)

    def _table_now(self) -> ReadTable | None:
        """The read table of the session already open, with no call and no wait on the
        session's lock (another thread may be in a call on this client); None where there is
        none right now (no session yet, one that ended, another machine, no table)."""
        session = self._session
        if self._pool_local is False or not self._copy_gets_up_to:
            return None
        if session is None or not session.alive:
            return None
        return self._tables.get(session.read_table, self._maps)

    def _table_copies(self, names: list[str]) -> list[Any] | None:
        """Copies of every key's entry out of the daemon's read table, with no call (the hits
        are posted to the daemon, which counts them), or None where any one is not readable
        so, or the session is gone: ask the daemon then."""
        table = self._read_table()
        if table is None:
            return None
        copies = table.read_all(names, self._copy_gets_up_to)
        if copies is None or not self._touched(names):
            return None
        return copies

    def _table_to_cuda(self, names: list[str], device: torch.device) -> list[Any] | None:
        """``get(names, device)`` copied out of the pool this process maps, with no call
        (``device/table_reads.py``), or None: ask the daemon."""
        table = self._read_table()
        if table is None:
            return None
        copies = table_reads.to_cuda(table, names, device)
        if copies is None or not self._touched(names):
            return None
        return copies

    @overload
    def _table_into_cuda(
        self, names: list[str], out: torch.Tensor, offsets: Sequence[int] | None
    ) -> list[IntoResult] | None: ...
    @overload
    def _table_into_cuda(
        self, names: list[str], out: Sequence[torch.Tensor]
    ) -> list[bool] | None: ...
    def _table_into_cuda(
        self,
        names: list[str],
        out: torch.Tensor | Sequence[torch.Tensor],
        offsets: Sequence[int] | None = None,
    ) -> list[IntoResult] | list[bool] | None:
        """``get_into`` a CUDA buffer, or CUDA tensors, with no call, or None."""
        table = self._read_table()
        if table is None:
            return None
        if isinstance(out, torch.Tensor):
            found: list[IntoResult] | list[bool] | None
            found = table_reads.into_cuda_buffer(table, names, out, offsets)
        else:
            found = table_reads.into_cuda_tensors(table, names, out)
        if found is None or not self._touched(names):
            return None
        return found

    def _touched(self, names: list[str]) -> bool:
        """Post the hits of a table read to the daemon (its stats and LRU see them at once);
        False when the session is gone: the daemon went, and the call path says so."""
        session = self._open_session()
        try:  # sent now, not with the next call
            session.post(now=True, touch=pb.TouchRequest(keys=names))
        except SessionLost:
            return False
        return True

    # -- leases of views (core/views.py) ---------------------------------------------------
    def _lease_lifetime(self, ttl_s: float | None) -> float:
        """How long a lease taken now lives (what was asked, or the session's default)."""
        session = self._session
        return ttl_s or (session.lease_ttl_s if session is not None else 0.0) or 1.0

    def _release_later(self, lease_ids: list[int]) -> bool:
        """Release these with the next call, or from the pump (``ViewLeases.release_later``):
        the pump is poked only for the first of a run of them (``_tend_views`` then keeps
        looking every ``LINGER_S`` while more come), so a get does not wake it each time.
        Returns True: queued (the leased tensors' ``post``)."""
        idle = not self._views.pending()
        self._views.release_later(lease_ids)
        if idle:
            self._pump.poke()
        return True

    def _hold_views(
        self, decoded: Decoded, ttl_s: float | None, taken_at: float, device: Any = None
    ) -> tuple[ViewLeases, list[Any]]:
        """Track the leases of ``decoded``'s views (taken by a get sent at ``taken_at``): they
        end once their block has ended and their views are gone. Returns the table and the
        anchors, for the leased tensors to hold until their block ends."""
        session = self._session
        lifetime = self._lease_lifetime(ttl_s)
        anchors = []
        for lease_id, anchor in zip(decoded.lease_ids, decoded.anchors, strict=True):
            if anchor is not None:
                self._views.track(
                    lease_id,
                    anchor,
                    ttl_s=ttl_s,
                    lifetime_s=lifetime,
                    taken_at=taken_at,
                    owner=session,
                    device=device,
                )
                anchors.append(anchor)
        if anchors:
            self._pump.poke()
        return self._views, anchors

    def _tend_views(self) -> float | None:
        """One round of the pump: release the leases whose views are gone, renew the others
        before their TTL; returns the seconds until the next round (None: nothing held)."""
        released = self._release_gone()
        if self._views.unsent:
            self._send_unsent()
        if self._closed and not len(self._views):  # close() waited for the last view
            self._shut()
            return -1.0  # the pump ends
        for ttl_s, ids in self._views.due():
            self._renew_views(ids, ttl_s)
        later = self._views.next_round()
        if self._views.unsent:  # no session could be opened for them: try again
            return min(later or LINGER_S, LINGER_S)
        if later is None and released:
            # Releases came in (copies' leases, which _release_later queues without a
            # wake): look again in a second instead of sleeping until the next poke, so
            # a client that stops calling still ends them, and one that keeps getting
            # costs one wake a second rather than one a get.
            later = LINGER_S
        return later

    def _release_gone(self) -> int:
        """Release the leases whose block ended and whose views are gone (after the device
        work of device views: what was queued on them before they went); how many."""
        ready = self._views.take_releasable()
        if not ready:
            return 0
        devices = {device for _, device in ready if device is not None}
        if devices:
            run_blocking(sync_devices, devices)
        self._release_quietly([lease_id for lease_id, _ in ready])
        return len(ready)

    def _post_gone(self, session: Any) -> None:
        """Before a call on ``session``: release what is gone without waiting for the
        answer (device views are left to the pump, which waits for their work first)."""
        ready = self._views.take_releasable(devices=False)
        if not ready:
            return
        ids = [lease_id for lease_id, _ in ready]
        if serves(session, "release"):
            try:
                session.post(release=pb.ReleaseRequest(lease_ids=ids))
                return
            except SessionLost:
                pass  # its leases ended with it; a release still ends a quarantine
        self._release_quietly(ids)

    def _release_quietly(self, lease_ids: list[int]) -> None:
        for i in range(0, len(lease_ids), BATCH):
            try:
                self.release(lease_ids[i : i + BATCH])
            except EmbCacheError as exc:  # nobody waits for it; the session or TTL ends them
                log.info("releasing leases whose views are gone failed: %s", exc)

    def _renew_views(self, lease_ids: list[int], ttl_s: float | None) -> None:
        """Renew these, in halves when some had ended (the daemon only counts them) so
        that each lost one is marked once."""
        since = time.monotonic()
        request = renew_request(lease_ids, ttl_s)
        session = self._session  # the leases' owner (not a new session: it would own none)
        metadata = self._auth
        if session is not None and session.session_id is not None:
            metadata = (*metadata, (SESSION_KEY, session.session_id))
        try:
            reply = self._call(
                lambda md, to: self._stub.Renew(request, timeout=to, metadata=metadata)
            )
        except EmbCacheError as exc:
            log.info(
                "renewing the leases of live views failed (%d of them): %s", len(lease_ids), exc
            )
            self._views.retry_later(lease_ids, 1.0)
            return
        if reply.renewed >= len(set(lease_ids)):
            self._views.renewed(lease_ids, since)
        elif len(lease_ids) == 1:
            self._views.lost(lease_ids)
            log.warning(
                "lease %d ended while views of it were alive (a TTL or session end); the "
                "block's end raises LeaseExpired",
                lease_ids[0],
            )
        else:
            half = len(lease_ids) // 2
            self._renew_views(lease_ids[:half], ttl_s)
            self._renew_views(lease_ids[half:], ttl_s)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
