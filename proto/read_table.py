"""The read table's bytes: where same-node clients look entries up without a call.

The daemon keeps, in a shared-memory file beside its host pool (``<segment>.reads``), a
table of the READY entries a client may copy straight out of the pool: per entry its key's
digest, its meta and its page runs (``docs/same_node_reads.md``). The daemon is the only
writer; clients map the file read-only. Every slot carries a sequence number that is odd
while the daemon rewrites the slot and grows by two with every change, so a reader that
sees the same even number before and after its copy knows the entry was neither changed
nor taken away meanwhile (a seqlock). The daemon bumps it before an entry's pages can go
back to the allocator, so a copy whose check passes holds the entry's bytes, whole.

Layout, little-endian: a 64-byte header (``HEADER``), then ``num_buckets * WAYS`` slots of
``SLOT_BYTES``; a key's bucket is fixed by its digest (:func:`bucket_of`), and it may sit in
any of the bucket's ways. An entry that does not fit (its bucket full, more than
``MAX_RUNS`` runs or ``MAX_DIMS`` dimensions) is simply not in the table: the table is a
shortcut, never the truth, and a key not found in it is asked of the daemon. ``VERSION``
changes whenever any of this does; a client that reads another version does not use it.

Since version 2 a slot also says where the entry is resident in the daemon's device pools:
up to ``DEVICE_SECTIONS`` sections after the body (``DEVICE``), each naming a pool by its
index in the list the daemon announces (``ReadTableInfo.device_pools``) and that pool's page
runs (first page, page count, in the pool's own pages), at most ``DEVICE_RUNS`` of them. A
section is written only once the copy that filled those pages is complete, and cleared
before the pages can be reused; both are changes of the slot, bracketed by its sequence
number like any other (``docs/same_node_reads.md``, "Device-resident hits"). A residency
with more runs, or in more pools than a slot has sections, is simply not offered.
"""

from __future__ import annotations

import hashlib
import struct

from embcache.proto.dtypes import DTYPES

PageRuns = tuple[tuple[int, int], ...]  # (first page, page count) each, in order

MAGIC = b"EMBCRTB\x00"
VERSION = 2
SUFFIX = ".reads"  # the table's file: the host pool segment's name plus this
WAYS = 8  # slots per bucket
MAX_DIMS = 8
MAX_RUNS = 16
SLOT_BYTES = 512
DEVICE_SECTIONS = 4  # device pools a slot can name
DEVICE_RUNS = 8  # page runs per device section
HEADER_BYTES = 64
# magic, version, slot bytes, ways, max dims, max runs, (pad), buckets, page bytes, closed
HEADER = struct.Struct("<8sIIIIII QQQ")
CLOSED_AT = 48  # the header's ``closed`` word: nonzero once the table must not be used
SEQ = struct.Struct("<Q")  # a slot's first word
# After the sequence word: digest, nbytes, live, dtype code, ndim, number of runs, shape
# (MAX_DIMS int64, unused ones 0), runs (MAX_RUNS pairs of first page and page count).
BODY = struct.Struct(f"<16sQBBBB4x{MAX_DIMS}q{2 * MAX_RUNS}I")
DIGEST_AT = SEQ.size  # where a slot's digest starts
LIVE_AT = DIGEST_AT + 16 + 8  # the slot's ``live`` byte (after the digest and nbytes)
# After the body: DEVICE_SECTIONS sections of live, pool index, number of runs, then the
# runs (DEVICE_RUNS pairs of first page and page count in that pool's pages).
DEVICE = struct.Struct(f"<BBBx{2 * DEVICE_RUNS}I")
DEVICE_AT = SEQ.size + BODY.size  # where a slot's first device section starts
# The header's word after ``closed``: the device sections' geometry (sections, runs each).
DEVICE_HEADER = struct.Struct("<HH")
DEVICE_HEADER_AT = HEADER.size
assert DEVICE_HEADER_AT + DEVICE_HEADER.size <= HEADER_BYTES
assert HEADER.size <= HEADER_BYTES and DEVICE_AT + DEVICE_SECTIONS * DEVICE.size <= SLOT_BYTES

# The element types by code: a code is the dtype's index in ``proto.dtypes`` plus one (0 is
# none); that list is append-only for this reason.
DTYPE_CODES = tuple(DTYPES)
CODE_OF = {name: i + 1 for i, name in enumerate(DTYPE_CODES)}


def digest(key: str) -> bytes:
    """The 16-byte digest a key is found by (BLAKE2b of its UTF-8 bytes); never all zero
    in practice, and two keys that share one are as likely as a random 128-bit collision."""
    return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def bucket_of(key_digest: bytes, num_buckets: int) -> int:
    """The bucket of a digest in a table of ``num_buckets`` (a power of two)."""
    return int.from_bytes(key_digest[8:], "little") & (num_buckets - 1)


def slot_offset(bucket: int, way: int) -> int:
    """Byte offset of a slot in the file."""
    return HEADER_BYTES + (bucket * WAYS + way) * SLOT_BYTES


def file_bytes(num_buckets: int) -> int:
    """The file's size for ``num_buckets``."""
    return HEADER_BYTES + num_buckets * WAYS * SLOT_BYTES


def device_at(slot: int, section: int) -> int:
    """Byte offset of device section ``section`` of the slot at ``slot``."""
    return slot + DEVICE_AT + section * DEVICE.size


def pack_device(pool: int, runs: PageRuns) -> bytes:
    """A live device section: pool ``pool``'s page runs ``(first page, count)``.
    ValueError when they do not fit a section (too many runs, a value out of range)."""
    if not 0 <= pool < 256 or len(runs) > DEVICE_RUNS:
        raise ValueError(f"device section: pool {pool}, {len(runs)} runs do not fit")
    flat = [x for run in runs for x in run]
    flat += [0] * (2 * DEVICE_RUNS - len(flat))
    try:
        return DEVICE.pack(1, pool, len(runs), *flat)
    except struct.error as exc:
        raise ValueError(f"device section: {exc}") from exc


def unpack_device(buf: bytes | memoryview, at: int = 0) -> tuple[int, PageRuns] | None:
    """The device section at ``at`` of ``buf``: ``(pool index, page runs)``, or None when it
    is not live or says more runs than a section holds (a slot changing under a reader)."""
    fields = DEVICE.unpack_from(buf, at)
    live, pool, nruns = fields[:3]
    if not live or nruns > DEVICE_RUNS:
        return None
    flat = fields[3:]
    return pool, tuple((flat[2 * i], flat[2 * i + 1]) for i in range(nruns))
