"""A client's connection to one daemon: the gRPC channel, the session, and the retries.

The session anchors the client's leases in the daemon: it is opened on first use
(``session_opener.py``) and kept for the life of the client, and when it ends (``close()``,
this process dies, the connection drops) the daemon releases them.

Every call gets the client's deadline and is retried on UNAVAILABLE with jittered
exponential backoff; a call that names a session the daemon forgot is tried again on a new
one.

The leases of views (``core/views.py``) are renewed by the connection's pump (a task, or a
thread in the blocking client) until their views are gone, then released (by the next call,
or the pump).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc

from embcache.clients._async.session_opener import TCP_CONNECT_S, AsyncSessionOpener
from embcache.clients._backends.async_io import CallFn, Lock, Pump, connect, run_blocking, sleep
from embcache.clients._backends.async_session import AsyncSession
from embcache.clients._backends.async_socket_session import AsyncSocketSession
from embcache.clients.core.channel import auth_metadata
from embcache.clients.core.errors import RpcFailed, from_call_error, translate
from embcache.clients.core.identity import default_client_name, default_token
from embcache.clients.core.requests import renew_request
from embcache.clients.core.retry import backoff_s, is_unknown_session, retry_step, should_retry
from embcache.clients.core.session_calls import SessionLost, serves
from embcache.clients.core.targets import normalize_target
from embcache.clients.core.views import BATCH, ViewLeases
from embcache.clients.device.device_replies import sync_devices
from embcache.errors import EmbCacheError
from embcache.proto.constants import SESSION_KEY
from embcache.proto.embcache.v1 import embcache_pb2 as pb

T = TypeVar("T")
log = logging.getLogger("embcache.client")


LINGER_S = 1.0  # how long the pump looks again for releases queued without a wake
SPIN_US = 300  # the blocking client's spin before it sleeps on the session socket


class AsyncConnection:
    """The channel, session and retries of a client, and the leases its views hold."""

    def __init__(
        self,
        target: str,
        *,
        token: str | None,
        timeout: float,
        retries: int,
        root_certificates: bytes | None,
        tls: bool,
        private_key: bytes | None,
        certificate_chain: bytes | None,
        client_name: str | None,
        options: Sequence[tuple[str, Any]],
        session_socket: bool,
        spin_us: int,
    ) -> None:
        """Prepare the connection (the client's constructor documents the arguments);
        nothing is sent until the first call."""
        target = normalize_target(target)
        self._channel, self.stub, self.put_stream, self.bytes_stream = connect(
            target,
            tls=tls,
            root_certificates=root_certificates,
            options=options,
            private_key=private_key,
            certificate_chain=certificate_chain,
        )
        self.target = target
        self.timeout = timeout  # the deadline of every call, in seconds
        self.retries = retries  # tries again while the daemon is UNAVAILABLE
        token = default_token(token)
        self.auth = auth_metadata(token)
        # The daemon keeps 256 characters, and reads a first message of a few KiB only.
        self.opener = AsyncSessionOpener(
            self.stub,
            target,
            token,
            default_client_name(client_name)[:256],
            session_socket=session_socket,
            secure=tls or root_certificates is not None or private_key is not None,
            spin_s=max(spin_us, 0) / 1e6,
        )
        self.session: AsyncSession | AsyncSocketSession | None = None  # changed under the lock
        self._session_lock = Lock()
        self._closed = False
        self.views = ViewLeases()  # leases held until their block ends and views are gone
        self._pump = Pump(self._tend_views, "embcache-views")
        self._unsent_retry_at = 0.0  # releases waiting for a session: not tried before this
        self._unsent_failures = 0

    # -- the session -----------------------------------------------------------------------
    async def _session_id(self) -> str:
        session = await self.open_session()
        assert session.session_id is not None
        return session.session_id

    async def open_session(self) -> AsyncSession | AsyncSocketSession:
        """The live session, opened (with the retries of a call) if there is none."""
        async with self._session_lock:
            if self._closed:
                raise RpcFailed("client is closed", "CANCELLED")
            return await self._live_session(retry=True)

    async def _live_session(self, *, retry: bool) -> AsyncSession | AsyncSocketSession:
        """Lock held: the session, or a new one if it ended (``retry``: with the retries of
        a call, else one short try); the releases that waited for a session go out first
        on a new one."""
        if self.session is None or not self.session.alive:
            if self.session is not None:
                await self.session.close()  # ended: let go of its socket or reader
                self.session = None
            if retry:  # a retry (UNAVAILABLE: a restarting daemon) looks for the socket again
                self.session = await self.call(self._open_new, tend=False)
            else:
                wait_s = min(self.timeout, TCP_CONNECT_S)
                self.session = await self.opener.open(self.auth, wait_s, self.timeout)
            await self._post_unsent(self.session)
        return self.session

    async def _open_new(self, metadata: Any, timeout: float) -> AsyncSession | AsyncSocketSession:
        return await self.opener.open(metadata, timeout, self.timeout)

    async def _post_unsent(self, session: AsyncSession | AsyncSocketSession) -> None:
        """Send on ``session`` the releases that found no live session (``core/views.py``):
        the daemon ends the holds it kept for this process's views (its quarantine) when
        they come from a session of the same process, and no one else's."""
        ids = self.views.take_unsent()
        if not ids or not serves(session, "release"):
            return  # (an old daemon: it kept no such holds)
        try:
            for i in range(0, len(ids), BATCH):
                await session.post(
                    now=True, release=pb.ReleaseRequest(lease_ids=ids[i : i + BATCH])
                )
        except SessionLost:
            self.views.keep_unsent(ids)  # the next session, then

    async def _send_unsent(self) -> None:
        """The pump's part: releases wait and no session lives, so open one for them (one
        short try; if the daemon is away, again after a backoff of up to a minute)."""
        if time.monotonic() < self._unsent_retry_at:
            return
        try:
            async with self._session_lock:
                await self._live_session(retry=False)
            self._unsent_failures = 0
        except (EmbCacheError, grpc.RpcError, OSError, TimeoutError) as exc:
            log.debug("no session for the releases of views that are gone yet: %s", exc)
            self._unsent_retry_at = time.monotonic() + min(2.0**self._unsent_failures, 60.0)
            self._unsent_failures += 1

    async def drop_session(self) -> None:
        """End the session (its leases end with it); the next call opens a new one."""
        async with self._session_lock:
            if self.session is not None:
                await self.session.close()
                self.session = None

    # -- calls -----------------------------------------------------------------------------
    async def call(self, fn: CallFn[T], *, session: bool = False, tend: bool = True) -> T:
        """Run ``fn(metadata, timeout)`` with retries on UNAVAILABLE (and a stale session).
        ``tend``: first release the leases whose views are gone (not from the session's
        opening or a release itself, which that would re-enter)."""
        if tend and self.views.pending():
            await self.release_gone()  # so that an evict, say, finds them released
        reopened = False
        attempt = 0
        while True:
            metadata = self.auth
            if session:
                metadata = (*metadata, (SESSION_KEY, await self._session_id()))
            try:
                return await fn(metadata, self.timeout)
            except grpc.RpcError as err:
                if session and not reopened and is_unknown_session(err):
                    reopened = True
                    await self.drop_session()
                    continue
                if should_retry(err) and attempt < self.retries:
                    await sleep(backoff_s(attempt))
                    attempt += 1
                    continue
                raise translate(err) from err

    async def session_call(
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
            session = await self.open_session()
            if not serves(session, kind):
                return await self.call(rpc, session=True)  # releases what is gone first
            if self.views.pending():
                await self._post_gone(session)  # rides in front of this call
            try:
                if take is None:  # no raw bytes follow this kind's result
                    result, payload = await session.call(self.timeout, **{kind: request}), None
                else:
                    result, payload = await session.call_with_payload(
                        self.timeout, **{kind: request}
                    )
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
                await self.drop_session()  # the daemon forgot it: start a new one
            else:
                await sleep(backoff_s(attempt))
            attempt += 1

    async def get_call(self, request: pb.GetRequest) -> pb.GetResponse:
        """A Get whose leases belong to this client's session (see :meth:`session_call`)."""
        return await self.session_call(
            "get", request, lambda md, to: self.stub.Get(request, timeout=to, metadata=md)
        )

    # -- leases and life cycle -------------------------------------------------------------
    async def release(self, lease_ids: Sequence[int]) -> int:
        """End leases (the client's ``release``); how many the daemon ended."""
        if not lease_ids:
            return 0
        request = pb.ReleaseRequest(lease_ids=lease_ids)
        # The session as it is: opening one here would wait on a daemon that is away (a
        # release from the views' pump); the next call opens it, and releases what went
        # meanwhile over it (``_post_gone``), ending what the daemon quarantined.
        session = self.session
        if session is not None and session.alive and session.serves_calls:
            try:
                result = await session.call(self.timeout, release=request)
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
            self.views.keep_unsent(lease_ids)
            self._pump.poke()
            return 0
        metadata = ((SESSION_KEY, sid),)

        reply = await self.call(
            lambda md, to: self.stub.Release(request, timeout=to, metadata=(*md, *metadata)),
            tend=False,
        )
        return int(reply.released)

    async def close(self) -> None:
        """Refuse new calls (those that need a session raise ``RpcFailed``, code
        ``CANCELLED``), then end the session (the daemon releases its leases) and close the
        channel: at once, or, while tensors of views are still held, once the last of them
        is gone (the pump does it then), so that they keep their bytes."""
        if self._closed:
            return
        await self._pump.stop()  # no round runs from here on
        self._closed = True
        await self.release_gone()
        if self.views.unsent and not len(self.views):
            await self._send_unsent()
        if len(self.views):
            log.debug("the session ends once its views are gone (%d left)", len(self.views))
            self._pump = Pump(self._tend_views, "embcache-views-closing")
            self._pump.poke()
            return
        await self._shut()

    async def _shut(self) -> None:
        await self.drop_session()
        await self._channel.close()

    # -- leases of views (core/views.py) ---------------------------------------------------
    def wake(self) -> None:
        """Have the pump look at the views' leases soon (a view was taken, or queued)."""
        self._pump.poke()

    async def _tend_views(self) -> float | None:
        """One round of the pump: release the leases whose views are gone, renew the others
        before their TTL; returns the seconds until the next round (None: nothing held)."""
        released = await self.release_gone()
        if self.views.unsent:
            await self._send_unsent()
        if self._closed and not len(self.views):  # close() waited for the last view
            await self._shut()
            return -1.0  # the pump ends
        for ttl_s, ids in self.views.due():
            await self._renew_views(ids, ttl_s)
        later = self.views.next_round()
        if self.views.unsent:  # no session could be opened for them: try again
            return min(later or LINGER_S, LINGER_S)
        if later is None and released:
            # Releases came in (copies' leases, which ViewHolds.release_later queues without a
            # wake): look again in a second instead of sleeping until the next poke, so
            # a client that stops calling still ends them, and one that keeps getting
            # costs one wake a second rather than one a get.
            later = LINGER_S
        return later

    async def release_gone(self) -> int:
        """Release the leases whose block ended and whose views are gone (after the device
        work of device views: what was queued on them before they went); how many."""
        ready = self.views.take_releasable()
        if not ready:
            return 0
        devices = {device for _, device in ready if device is not None}
        if devices:
            await run_blocking(sync_devices, devices)
        await self._release_quietly([lease_id for lease_id, _ in ready])
        return len(ready)

    async def _post_gone(self, session: Any) -> None:
        """Before a call on ``session``: release what is gone without waiting for the
        answer (device views are left to the pump, which waits for their work first)."""
        ready = self.views.take_releasable(devices=False)
        if not ready:
            return
        ids = [lease_id for lease_id, _ in ready]
        if serves(session, "release"):
            try:
                await session.post(release=pb.ReleaseRequest(lease_ids=ids))
                return
            except SessionLost:
                pass  # its leases ended with it; a release still ends a quarantine
        await self._release_quietly(ids)

    async def _release_quietly(self, lease_ids: list[int]) -> None:
        for i in range(0, len(lease_ids), BATCH):
            try:
                await self.release(lease_ids[i : i + BATCH])
            except EmbCacheError as exc:  # nobody waits for it; the session or TTL ends them
                log.info("releasing leases whose views are gone failed: %s", exc)

    async def _renew_views(self, lease_ids: list[int], ttl_s: float | None) -> None:
        """Renew these, in halves when some had ended (the daemon only counts them) so
        that each lost one is marked once."""
        since = time.monotonic()
        request = renew_request(lease_ids, ttl_s)
        session = self.session  # the leases' owner (not a new session: it would own none)
        metadata = self.auth
        if session is not None and session.session_id is not None:
            metadata = (*metadata, (SESSION_KEY, session.session_id))
        try:
            reply = await self.call(
                lambda md, to: self.stub.Renew(request, timeout=to, metadata=metadata)
            )
        except EmbCacheError as exc:
            log.info(
                "renewing the leases of live views failed (%d of them): %s", len(lease_ids), exc
            )
            self.views.retry_later(lease_ids, 1.0)
            return
        if reply.renewed >= len(set(lease_ids)):
            self.views.renewed(lease_ids, since)
        elif len(lease_ids) == 1:
            self.views.lost(lease_ids)
            log.warning(
                "lease %d ended while views of it were alive (a TTL or session end); the "
                "block's end raises LeaseExpired",
                lease_ids[0],
            )
        else:
            half = len(lease_ids) // 2
            await self._renew_views(lease_ids[:half], ttl_s)
            await self._renew_views(lease_ids[half:], ttl_s)
