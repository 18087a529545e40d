"""The element types embcache stores, by wire name."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class DType:
    name: str
    itemsize: int
    torch_dtype: torch.dtype


# Append only: the read table (read_table.py) numbers the dtypes in this order.
_ALL = [
    DType("bfloat16", 2, torch.bfloat16),
    DType("float16", 2, torch.float16),
    DType("float32", 4, torch.float32),
    DType("float64", 8, torch.float64),
    DType("float8_e4m3fn", 1, torch.float8_e4m3fn),
    DType("float8_e5m2", 1, torch.float8_e5m2),
    DType("int8", 1, torch.int8),
    DType("uint8", 1, torch.uint8),
    DType("int16", 2, torch.int16),
    DType("int32", 4, torch.int32),
    DType("int64", 8, torch.int64),
    DType("bool", 1, torch.bool),
]

DTYPES: dict[str, DType] = {d.name: d for d in _ALL}
_BY_TORCH: dict[torch.dtype, DType] = {d.torch_dtype: d for d in _ALL}


def lookup(name: str) -> DType | None:
    """The dtype with this wire name (``bf16``/``fp16``/``fp32`` are accepted too), or None."""
    return DTYPES.get(_ALIASES.get(name, name))


def names() -> list[str]:
    """Every name :func:`lookup` accepts: the wire names and their aliases."""
    return [*DTYPES, *_ALIASES]


def from_torch(dtype: torch.dtype) -> DType | None:
    return _BY_TORCH.get(dtype)


_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
    "fp64": "float64",
    "double": "float64",
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a wire name the daemon sent; ValueError for one it does not know."""
    dt = lookup(name)
    if dt is None:
        raise ValueError(f"the daemon sent an unknown dtype {name!r}")
    return dt.torch_dtype
