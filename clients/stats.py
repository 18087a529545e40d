"""Plain-Python views of Stats and Evict replies."""

from __future__ import annotations

from typing import Any

from google.protobuf import json_format

from embcache.proto.embcache.v1 import embcache_pb2 as pb

EVICT_NAMES = {pb.EVICTED: "evicted", pb.NOT_FOUND: "not_found", pb.LEASED: "leased"}


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
    out: dict[str, Any] = _ints(json_format.MessageToDict(reply.stats))
    out["grpc_sessions"] = reply.sessions
    return out
