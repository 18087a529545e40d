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
"""

from __future__ import annotations

import hashlib
import struct

from embcache.proto.dtypes import DTYPES

MAGIC = b"EMBCRTB\x00"
VERSION = 1
SUFFIX = ".reads"  # the table's file: the host pool segment's name plus this
WAYS = 8  # slots per bucket
MAX_DIMS = 8
MAX_RUNS = 16
SLOT_BYTES = 256
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
assert HEADER.size <= HEADER_BYTES and SEQ.size + BODY.size <= SLOT_BYTES

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
