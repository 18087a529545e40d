"""Replies read the same way by both clients: bytes streams, stats, evict and prefetch
outcomes, and the count a Release returns."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
from google.protobuf import json_format
from google.protobuf.message import DecodeError

from embcache.errors import EntryLeased, LeaseExpired, NotFound
from embcache.proto.dtypes import torch_dtype
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.proto.framing import chunk_payload

EVICT_NAMES = {pb.EVICTED: "evicted", pb.NOT_FOUND: "not_found", pb.LEASED: "leased"}


@dataclass(slots=True)
class EntryBytes:
    """An entry fetched as bytes (``get_bytes``): works from any machine."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    data: bytearray

    def tensor(self) -> torch.Tensor:
        """The bytes as a tensor (shares memory with ``data``)."""
        flat = (
            torch.frombuffer(self.data, dtype=torch.uint8)
            if self.data
            else torch.empty(0, dtype=torch.uint8)
        )
        return flat.view(torch_dtype(self.dtype)).view(self.shape)


class BytesCollector:
    """Assembles a GetBytes stream into one preallocated buffer. Messages come serialized
    (``core.channel.connect``): a chunk's payload is copied once, from the received bytes
    into the buffer, without a protobuf message in between."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.meta: pb.TensorMeta | None = None
        self.buf = bytearray()
        self.pos = 0

    def add(self, data: bytes, length: int | None, offset: int) -> None:
        """One serialized ``GetBytesResponse``."""
        chunk: Any = chunk_payload(data)
        if chunk is None:  # the meta message (or a chunk another encoder wrote)
            try:
                message = pb.GetBytesResponse.FromString(data)
            except DecodeError as exc:
                raise ValueError(f"GetBytes stream message undecodable: {exc}") from None
            kind = message.WhichOneof("kind")
            if kind == "meta":
                self.meta = message.meta
                want = message.meta.nbytes - offset if length is None else length
                self.buf = bytearray(max(want, 0))
                return
            if kind != "chunk":
                return  # a field this client does not know
            chunk = message.chunk
        if self.meta is None or self.pos + len(chunk) > len(self.buf):
            raise ValueError("GetBytes stream out of order or longer than announced")
        self.buf[self.pos : self.pos + len(chunk)] = chunk
        self.pos += len(chunk)

    def result(self) -> EntryBytes:
        if self.meta is None or self.pos != len(self.buf):
            raise ValueError("GetBytes stream ended early")
        return EntryBytes(self.key, self.meta.dtype, tuple(self.meta.shape), self.buf)


def evict_outcomes(
    names: list[str], single: bool, *, reply: Any = None, failure: Exception | None = None
) -> str | list[str]:
    """What evict returns for its reply, or for its error: a list asked with one key gets
    that key's outcome (NotFound, EntryLeased) instead of the error."""
    if failure is not None:
        if single or len(names) != 1:
            raise failure
        if isinstance(failure, NotFound):
            return ["not_found"]
        if isinstance(failure, EntryLeased):
            return ["leased"]
        raise failure
    outcomes = [EVICT_NAMES[r.outcome] for r in reply.results]
    return outcomes[0] if single else outcomes


def prefetch_dict(reply: pb.PrefetchResponse) -> dict[str, int]:
    """A Prefetch reply's counts by name."""
    return {
        f: int(getattr(reply, f)) for f in ("requested", "local", "fetched", "missing", "resident")
    }


def _ints(value: Any) -> Any:
    # google.protobuf.Struct carries every number as a double: give counters back as ints.
    if isinstance(value, dict):
        return {k: _ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_ints(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def stats_dict(reply: pb.StatsResponse) -> dict[str, Any]:
    """The daemon's stats document as plain Python, with the open sessions added: from
    ``stats_json`` (integers exact) where the daemon sets it, else from the Struct."""
    if reply.stats_json:
        out: dict[str, Any] = json.loads(reply.stats_json)
    else:  # an older daemon: doubles only, integral ones read back as ints
        out = _ints(json_format.MessageToDict(reply.stats))
    out["grpc_sessions"] = reply.sessions
    return out


def check_ended(ended: object, lease_ids: list[int], lost: int = 0) -> None:
    """Raise if the daemon ended fewer leases than were held (some had expired already), or
    if ``lost`` leases still held by views are known to have ended."""
    held = len(set(lease_ids))
    if (isinstance(ended, int) and ended < held) or lost:
        raise LeaseExpired(
            "a lease ended before it was released (e.g. the reader was stopped past its "
            "TTL): data read through the zero-copy views may be reused memory; read again",
            held=held + lost,
            released=ended,
        )
