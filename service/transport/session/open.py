"""An open session, whichever transport carries it: its calls, its hello, and its end.

A session is opened by a gRPC ``Session`` stream or by a connection to the session socket
(``session_socket/``). Either way its calls run through the same :class:`SessionCalls`, its leases
belong to its id, and when the stream or connection ends, so does the session: its running
calls are cancelled and everything it owned is dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.service.text import plural
from embcache.service.transport.session.calls import SessionCalls
from embcache.service.transport.session.registry import SessionRecord

log = logging.getLogger("embcache.session")


class OpenSession:
    """One open session (module docstring)."""

    def __init__(
        self,
        calls: SessionCalls,
        opened: pb.SessionOpened,
        end: Callable[[str], int],
        record: SessionRecord | None = None,
    ) -> None:
        self.calls = calls
        self.opened = opened
        self.session_id = opened.session_id
        self.hello = ""
        self.record = record  # what operators see of it (the registry's)
        self._end = end  # closes the id and drops what it owned; returns leases released

    def handle(self, msg: pb.SessionRequest, peer: str) -> None:
        """A call starts as a task; a hello names the session in the logs. (Pings are the
        transport's: they need a reply in order.)"""
        kind = msg.WhichOneof("kind")
        if kind == "call":
            self.calls.start(msg.call)
        elif kind == "hello":
            self.hello = f"{msg.hello.client_name} pid {msg.hello.pid}"
            if self.record is not None:
                self.record.client_name = msg.hello.client_name[:256]
                self.record.hello_pid = msg.hello.pid
            log.debug("session %s is %s (%s)", self.session_id, self.hello, peer)

    def end(self) -> None:
        """Close the session, cancel its running calls (each gives back the leases it took)
        and drop what it owned. Never awaits: a second cancellation must not skip it."""
        dropped = self._end(self.session_id)
        self.calls.cancel()
        if dropped:
            log.info(
                "session %s (%s) ended; released %s",
                self.session_id,
                self.hello,
                plural(dropped, "lease"),
            )
