"""Request validation that runs before any page is reserved.

Every check raises a typed error carrying the offending values. Python ints do not
overflow, but wire values come from int64/uint64 fields, so sizes are bounded explicitly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from embcache.errors import EntryTooLarge, InvalidArgument, MetadataConflict
from embcache.proto.dtypes import DType, lookup
from embcache.service.config import Settings
from embcache.service.host.entries import Entry

MAX_NDIM = 8
_INT64_MAX = 2**63 - 1


@dataclass(frozen=True, slots=True)
class EntryMeta:
    """Validated metadata of an entry: the collision guard compares these."""

    dtype: DType
    shape: tuple[int, ...]
    nbytes: int


def check_key(key: object, settings: Settings) -> str:
    """``key`` if it is a non-empty UTF-8 string without NUL within ``max_key_bytes``."""
    if not isinstance(key, str):
        raise InvalidArgument("key must be a string", key_type=type(key).__name__)
    if not key:
        raise InvalidArgument("key must not be empty")
    try:
        encoded = key.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgument("key is not valid UTF-8", reason=str(exc)) from None
    if len(encoded) > settings.max_key_bytes:
        raise InvalidArgument(
            "key is too long", key_bytes=len(encoded), max_key_bytes=settings.max_key_bytes
        )
    if "\x00" in key:
        raise InvalidArgument("key must not contain NUL characters")
    return key


def check_meta(
    dtype: object,
    shape: object,
    nbytes: int | None,
    settings: Settings,
) -> EntryMeta:
    """Validate dtype/shape/nbytes consistency and size limits."""
    if not isinstance(dtype, str) or (dt := lookup(dtype)) is None:
        raise InvalidArgument("unsupported dtype", dtype=str(dtype))
    if not isinstance(shape, Sequence) or isinstance(shape, (str, bytes)):
        raise InvalidArgument("shape must be a sequence of integers", shape=str(shape))
    if len(shape) > MAX_NDIM:
        raise InvalidArgument("too many dimensions", ndim=len(shape), max_ndim=MAX_NDIM)
    dims: list[int] = []
    for i, d in enumerate(shape):
        if isinstance(d, bool) or not isinstance(d, int):
            raise InvalidArgument("shape entries must be integers", dim=i, value=str(d))
        if d < 0:
            raise InvalidArgument("shape entries must be >= 0", dim=i, value=d)
        dims.append(d)
    # The byte size of each dim's stride must fit int64 whatever the dims' order, zero dims
    # included: [0, 2**63-1] and [2**63-1, 0] are both refused or both accepted.
    strides = dt.itemsize
    for d in dims:
        strides *= max(d, 1)
        if strides > _INT64_MAX:
            raise InvalidArgument("shape overflows int64 bytes", shape=dims)
    expected = dt.itemsize
    for d in dims:
        expected *= d
    if nbytes is not None:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise InvalidArgument("nbytes must be a non-negative integer", nbytes=str(nbytes))
        if nbytes != expected:
            raise InvalidArgument(
                "nbytes does not match dtype and shape",
                nbytes=nbytes,
                expected=expected,
                dtype=dt.name,
                shape=dims,
            )
    if expected > settings.max_entry_bytes:
        raise EntryTooLarge(
            "entry is larger than max_entry_bytes",
            nbytes=expected,
            max_entry_bytes=settings.max_entry_bytes,
        )
    if expected > settings.host_pool_bytes:
        raise EntryTooLarge(
            "entry is larger than the host pool",
            nbytes=expected,
            host_pool_bytes=settings.host_pool_bytes,
        )
    return EntryMeta(dt, tuple(dims), expected)


def check_checksum(checksum: object) -> int | None:
    """A CRC32 a put declared (None: none declared), checked to fit in 32 bits."""
    if checksum is None:
        return None
    if isinstance(checksum, bool) or not isinstance(checksum, int) or not 0 <= checksum < 2**32:
        raise InvalidArgument(
            "checksum must be a CRC32 value (0 <= c < 2**32)", checksum=str(checksum)
        )
    return checksum


def check_ttl(ttl_s: float | None, settings: Settings) -> float:
    """A lease lifetime a request asked for (the settings' ``lease_ttl_s`` for None)."""
    if ttl_s is None:
        return settings.lease_ttl_s
    if not (isinstance(ttl_s, (int, float)) and math.isfinite(ttl_s) and ttl_s > 0):
        raise InvalidArgument("ttl_s must be a positive finite number", ttl_s=str(ttl_s))
    if ttl_s > settings.max_lease_ttl_s:
        raise InvalidArgument(
            "ttl_s is longer than max_lease_ttl_s",
            ttl_s=ttl_s,
            max_lease_ttl_s=settings.max_lease_ttl_s,
        )
    return float(ttl_s)


def check_same_meta(existing: Entry, dtype: DType, shape: tuple[int, ...]) -> None:
    """The collision guard: MetadataConflict unless ``existing`` has this dtype and shape."""
    if not existing.same_meta(dtype, shape):
        raise MetadataConflict(
            "key exists with different metadata",
            key=existing.key,
            existing_dtype=existing.dtype.name,
            existing_shape=list(existing.shape),
            dtype=dtype.name,
            shape=list(shape),
        )
