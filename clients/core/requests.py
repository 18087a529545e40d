"""Requests the clients build the same way, whatever their flavour."""

from __future__ import annotations

from collections.abc import Sequence

from embcache.proto.embcache.v1 import embcache_pb2 as pb


def as_keys(keys: str | Sequence[str]) -> tuple[list[str], bool]:
    """(list of keys, whether a single key was given)."""
    if isinstance(keys, str):
        return [keys], True
    keys = list(keys)
    for key in keys:
        if not isinstance(key, str):
            raise TypeError(f"keys must be strings, not {type(key).__name__}")
    return keys, False


def get_request(keys: list[str], ttl_s: float | None) -> pb.GetRequest:
    """A host Get; ``ttl_s`` (when set) asks for leases of that lifetime."""
    return pb.GetRequest(keys=keys, ttl_s=ttl_s) if ttl_s else pb.GetRequest(keys=keys)


def device_get_request(
    keys: list[str], gpu_uuid: str, ttl_s: float | None, *, ready_event: bool
) -> pb.GetRequest:
    """A Get into ``gpu_uuid``'s device pool; with ``ready_event`` the daemon may answer
    before its copy is done, naming an event that fires when it is."""
    request = pb.GetRequest(keys=keys, gpu_uuid=gpu_uuid, ready_event=ready_event)
    if ttl_s:
        request.ttl_s = ttl_s
    return request


def evict_request(keys: list[str], gpu_uuid: str | None = None) -> pb.EvictRequest:
    """An Evict request; ``gpu_uuid`` limits it to the keys' copies on that GPU (their host
    copies stay)."""
    request = pb.EvictRequest(keys=keys)
    if gpu_uuid is not None:
        request.gpu_uuid = gpu_uuid
    return request


def prefetch_request(keys: Sequence[str], gpu_uuid: str | None = None) -> pb.PrefetchRequest:
    """A Prefetch request; ``gpu_uuid`` also warms that GPU's device pool."""
    request = pb.PrefetchRequest(keys=list(keys))
    if gpu_uuid is not None:
        request.gpu_uuid = gpu_uuid
    return request


def renew_request(lease_ids: Sequence[int], ttl_s: float | None) -> pb.RenewRequest:
    """A Renew request; without ``ttl_s`` the daemon's default lifetime."""
    request = pb.RenewRequest(lease_ids=lease_ids)
    if ttl_s is not None:
        request.ttl_s = ttl_s
    return request
