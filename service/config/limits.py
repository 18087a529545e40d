"""The limit settings: entries, leases and each client's fair share of the daemon.

A group of fields that ``Settings`` is assembled from: the bounds that keep one client (a
session, a peer, a process) from taking the pool, the leases or the loop from the others.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from embcache.service.config.forms import ByteSize


class LimitSettings(BaseModel):
    """Keys, leases and per-client bounds (part of ``Settings``; every field is
    ``EMBCACHE_<FIELD>`` or ``--<field>``)."""

    # Entries and leases
    max_key_bytes: int = Field(1024, ge=1, le=65536, description="Longest key, in UTF-8 bytes.")
    lease_ttl_s: float = Field(
        60.0, gt=0, description="Lease lifetime unless released or renewed, in seconds."
    )
    max_lease_ttl_s: float = Field(
        3600.0, gt=0, description="Longest lease lifetime a client may ask for, in seconds."
    )
    max_inflight_bytes_per_client: ByteSize = Field(
        0, description="Bytes one client may have reserved in unfinished puts (0 = pool size)."
    )
    # Fair sharing (docs/reliability.md, "One client against the others")
    put_idle_timeout_s: float = Field(
        30.0, gt=0, le=3600, description="A put that receives no bytes for this long is "
        "aborted and its pages freed (gRPC Put streams, REST PUT bodies).",
    )  # fmt: skip
    max_entries: int = Field(
        0, ge=0, description="Most entries, zero-byte ones included; past it the least recently "
        "used are evicted (0: host pages + 1024).",
    )  # fmt: skip
    max_leases_per_owner: int = Field(
        16384, ge=1, description="Most leases one owner (a session, a peer) may hold at once."
    )
    max_leased_bytes_per_owner: ByteSize = Field(
        0, description="Most bytes of distinct entries one owner may hold leased at once "
        "(0: half the host pool, at least one largest entry).",
    )  # fmt: skip
    max_session_calls: int = Field(
        128, ge=1, le=65536, description="Calls one session may have in flight; past it the "
        "daemon stops reading that session's requests until one finishes.",
    )  # fmt: skip
    max_request_body_bytes: ByteSize = Field(
        1024**2, ge=1024, description="Largest JSON body of a REST control route (413 past "
        "it); PUT data bodies stream into pages and are bounded by the entry size.",
    )  # fmt: skip
    session_hello_timeout_s: float = Field(
        5.0, gt=0, le=600, description="A session-socket connection (Unix or TCP) that has not "
        "sent an accepted hello (with the token, when the daemon has one) this long after it "
        "connected is closed.",
    )  # fmt: skip
    session_hello_max_bytes: ByteSize = Field(
        4096, ge=256, le=1024**2, description="Largest message the session socket reads from a "
        "connection before its hello is accepted (at least the auth token's length plus 1 KiB); "
        "a larger one closes the connection before it is buffered.",
    )  # fmt: skip
    max_session_connections: int = Field(
        1024, ge=1, le=1_000_000, description="Most connections the session socket keeps open "
        "(Unix and TCP together, authenticated or not; never more than half the process's "
        "open-file limit); at it a new connection takes the place of the one that has waited "
        "longest for its hello (closed), or is refused and closed when every place is a "
        "session; sessions are never closed to make room.",
    )  # fmt: skip
    touch_window_s: float = Field(
        1.0, ge=0, le=3600, description="A client's posted touches (hits it served from the "
        "read table; its sessions together) count each key at most once per window of this "
        "many seconds, as a hit "
        "and as a move to the LRU's recent end (0: every time).",
    )  # fmt: skip
    max_touch_keys_per_s: int = Field(
        65536, ge=1, description="Keys one client (its sessions together: a process on the "
        "session socket, else an address) may report in touches per second (a burst "
        "of one second's worth); a touch past it is dropped whole and counted "
        "(embcache_touches_dropped_total), and the session goes on.",
    )  # fmt: skip
    max_quarantine_bytes_per_owner: ByteSize = Field(
        0,
        description="Pages one client process may keep held by views of leases that ended by "
        "force (a TTL, a dropped session) until it exits or drops the views; past it, its gets "
        "are refused with QuotaExceeded (0 = a quarter of the host pool).",
    )
