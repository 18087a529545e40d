"""Tensors flattened for a Put, and the Put stream's messages.

Put chunks are framed by hand (``embcache.proto.framing``), so each is copied once.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from embcache.proto.checksum import crc32
from embcache.proto.constants import CHUNK_BYTES
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.proto.framing import encode_chunk


@dataclass(frozen=True, slots=True)
class Payload:
    """A tensor flattened for a Put: wire dtype name, shape, and its bytes (no copy)."""

    dtype: str
    shape: tuple[int, ...]
    data: memoryview

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def header(self, key: str, *, checksum: bool = True) -> pb.PutHeader:
        header = pb.PutHeader(key=key, dtype=self.dtype, shape=self.shape, nbytes=self.nbytes)
        if checksum:
            header.checksum = crc32(self.data)
        return header

    def messages(self, key: str, *, checksum: bool = True) -> Iterator[Any]:
        """The Put stream: a header message, then 1 MiB memoryview chunks (see encode_put)."""
        yield pb.PutRequest(header=self.header(key, checksum=checksum))
        for start in range(0, self.nbytes, CHUNK_BYTES):
            yield self.data[start : start + CHUNK_BYTES]


def payload_of(tensor: Any) -> Payload:
    """Flatten a torch tensor or numpy array (any device; CUDA is copied to the host)."""
    if isinstance(tensor, torch.Tensor):
        t = tensor.detach()
        if t.device.type != "cpu":
            # A put from a device the daemon cannot read (client.put tried PutFromDevice
            # first): its bytes travel like any other.
            t = t.cpu()
        t = t.contiguous()
        dtype = str(t.dtype).removeprefix("torch.")
        flat = t.reshape(-1).view(torch.uint8).numpy()
        return Payload(dtype, tuple(t.shape), flat.data)
    if isinstance(tensor, np.ndarray):
        arr = np.ascontiguousarray(tensor)
        flat = arr.reshape(-1).view(np.uint8)
        return Payload(arr.dtype.name, tuple(arr.shape), flat.data)
    raise TypeError(f"put takes a torch.Tensor or numpy.ndarray, not {type(tensor).__name__}")


def encode_put(message: Any) -> bytes:
    """Request serializer of Put: protobuf for the header, hand-framed ``chunk`` fields."""
    if isinstance(message, pb.PutRequest):
        return message.SerializeToString()
    return encode_chunk(message)
