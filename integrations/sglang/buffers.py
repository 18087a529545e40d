"""Host pointers of SGLang's registered pools, turned back into tensors.

SGLang's embedding store calls hand over raw addresses (``data_ptr()`` of page runs in
its host pools) and byte counts. Only addresses inside a buffer given to
``register_buffer`` are accepted: a view of that buffer is then memory the engine owns
and keeps alive, never a guess at what an address points to.
"""

from __future__ import annotations

import bisect

import torch

from embcache.errors import InvalidArgument


class RegisteredBuffers:
    """The registered host buffers, as flat byte views sorted by address."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._views: list[torch.Tensor] = []

    def register(self, tensor: torch.Tensor) -> None:
        """Accept ``tensor``'s memory for later calls.

        Raises:
            InvalidArgument: not a contiguous CPU tensor, or overlapping one registered.
        """
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
            raise InvalidArgument("register_buffer needs a CPU (host) tensor")
        if not tensor.is_contiguous():
            raise InvalidArgument("register_buffer needs a contiguous tensor")
        flat = tensor.reshape(-1).view(torch.uint8)
        start, end = flat.data_ptr(), flat.data_ptr() + flat.numel()
        i = bisect.bisect_right(self._starts, start)
        if i > 0 and start < self._starts[i - 1] + self._views[i - 1].numel():
            if start == self._starts[i - 1] and end == start + self._views[i - 1].numel():
                return  # the same buffer again
            raise InvalidArgument("register_buffer: overlaps a registered buffer")
        if i < len(self._starts) and end > self._starts[i]:
            raise InvalidArgument("register_buffer: overlaps a registered buffer")
        self._starts.insert(i, start)
        self._views.insert(i, flat)

    def view(self, ptr: int, size: int) -> torch.Tensor:
        """``size`` bytes at ``ptr`` as a uint8 view of a registered buffer.

        Raises:
            InvalidArgument: a negative size, or a range not inside one registered buffer.
        """
        if not isinstance(ptr, int) or not isinstance(size, int) or size < 0:
            raise InvalidArgument("pointer and size must be integers, size >= 0", ptr=ptr)
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i < 0:
            raise InvalidArgument("pointer is not inside a registered buffer", ptr=hex(ptr))
        offset = ptr - self._starts[i]
        flat = self._views[i]
        if offset + size > flat.numel():
            raise InvalidArgument(
                "range is not inside a registered buffer", ptr=hex(ptr), size=size
            )
        return flat[offset : offset + size]

    def views(self, ptrs: list[int], sizes: list[int]) -> list[torch.Tensor]:
        """One view per (pointer, size) pair.

        Raises:
            InvalidArgument: the lists differ in length, or a range is not registered.
        """
        if len(ptrs) != len(sizes):
            raise InvalidArgument(
                "ptrs and sizes differ in length", ptrs=len(ptrs), sizes=len(sizes)
            )
        return [self.view(p, n) for p, n in zip(ptrs, sizes, strict=True)]
