"""Checksummed payloads: every byte of an entry can be checked knowing only its key.

Layout (bytes): ``MAGIC`` (8) | blake2b-16 of the key (16) | nbytes (8) | seed (8) |
crc32 of the body (4) | zeros to 64 | body (seeded random bytes). A reader checks that the
header names the key it asked for and the size it got, and the CRC over every body byte:
memory reused by another entry fails the key check, torn or stale bytes the CRC.
"""

from __future__ import annotations

import hashlib
import struct
import zlib

import numpy as np
import torch

MAGIC = b"EMBREL01"
HEADER = 64
MiB = 1 << 20
HIDDEN = 1024
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_FMT = "<8s16sQQI"


def key_hash(key: str) -> bytes:
    return hashlib.blake2b(key.encode(), digest_size=16).digest()


def make(key: str, nbytes: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A ``[rows, HIDDEN]`` tensor of ``dtype`` whose bytes carry ``key`` and a CRC."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    row = HIDDEN * itemsize
    assert nbytes % row == 0 and nbytes >= HEADER, (nbytes, row)
    buf = bytearray(nbytes)
    body = np.random.default_rng(seed).bytes(nbytes - HEADER)
    buf[HEADER:] = body
    head = struct.pack(_FMT, MAGIC, key_hash(key), nbytes, seed, zlib.crc32(body))
    buf[: len(head)] = head
    flat = torch.frombuffer(buf, dtype=torch.uint8)
    return flat.view(dtype).view(nbytes // row, HIDDEN)


def check(key: str, tensor: torch.Tensor | None) -> str | None:
    """None if ``tensor`` holds exactly the payload of ``key``, else what is wrong."""
    if tensor is None:
        return "missing"
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()  # a device view or copy: check its bytes on the host
    flat = tensor.reshape(-1).view(torch.uint8)  # a view for the zero-copy case
    data = memoryview(flat.numpy()) if flat.numel() else memoryview(b"")
    if data.nbytes < HEADER:
        return f"short entry ({data.nbytes} bytes)"
    magic, khash, nbytes, _seed, crc = struct.unpack_from(_FMT, data, 0)
    if magic != MAGIC:
        return "bad magic (not a payload, or reused memory)"
    if khash != key_hash(key):
        return "header names another key (reused memory)"
    if nbytes != data.nbytes:
        return f"size {data.nbytes} but header says {nbytes}"
    if zlib.crc32(data[HEADER:]) != crc:
        return "body CRC mismatch"
    return None


def check_bytes(key: str, data: bytes | bytearray | memoryview) -> str | None:
    """:func:`check` for bytes fetched with ``get_bytes``."""
    arr = np.frombuffer(data, dtype=np.uint8)
    if not arr.flags.writeable:  # torch wants writable memory; bytearrays need no copy
        arr = arr.copy()
    return check(key, torch.from_numpy(arr) if arr.size else torch.empty(0, dtype=torch.uint8))
