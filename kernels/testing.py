"""Helpers shared by the kernel tests and benchmarks: random plans, random rows, bit views.

Tests and benchmarks must exercise the same fragmented plans and compare bytes the same
way, so they share these instead of each writing its own.
"""

from __future__ import annotations

import numpy as np
import torch

Plan = tuple[np.ndarray, np.ndarray, np.ndarray]


def random_plan(
    rng: np.random.Generator,
    src_rows: int,
    dst_rows: int,
    num_ranges: int,
    max_len: int,
    *,
    fixed_len: bool = False,
    short_last: bool = False,
    zero_ranges: bool = False,
) -> Plan:
    """A random copy plan: disjoint destinations scattered over ``dst_rows`` in shuffled
    order, and sources anywhere (they may overlap).

    Args:
        rng: the random source.
        src_rows, dst_rows: rows of the source and destination tensors.
        num_ranges: how many ranges.
        max_len: the longest range, in rows.
        fixed_len: every range is ``max_len`` rows.
        short_last: every range is ``max_len`` rows and the last one is 1 row.
        zero_ranges: one range, chosen at random, is empty.

    Returns:
        ``(src_starts, dst_starts, lengths)``, int64 numpy arrays.
    """
    lengths = rng.integers(1, max_len + 1, num_ranges)
    if (fixed_len or short_last) and num_ranges:
        lengths[:] = max_len
    if short_last and num_ranges:
        lengths[-1] = 1
    if zero_ranges and num_ranges:
        lengths[rng.integers(0, num_ranges)] = 0
    slack = dst_rows - int(lengths.sum())
    assert slack >= 0, "plan does not fit the destination"
    cuts = np.sort(rng.integers(0, slack + 1, num_ranges))
    gaps = np.diff(np.concatenate([[0], cuts]))
    dst_starts = np.cumsum(gaps) + np.concatenate([[0], np.cumsum(lengths)[:-1]])
    order = rng.permutation(num_ranges)
    src_starts = rng.integers(0, src_rows - lengths + 1)
    return src_starts[order], dst_starts[order].astype(np.int64), lengths[order]


def swap_plan(plan: Plan) -> Plan:
    """The same ranges with source and destination exchanged (the other direction)."""
    return plan[1], plan[0], plan[2]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers, so NaN payloads and -0.0 compare exactly."""
    kinds = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(kinds[t.element_size()])


def random_rows(
    rows: int, width: int, dtype: torch.dtype, seed: int, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Random bytes seen as ``[rows, width]`` of ``dtype`` (NaNs included: compare with bits).

    Args:
        rows, width, dtype: the shape and dtype of the result.
        seed: the seed; the same seed gives the same bytes.
        out: a CPU tensor (e.g. pinned) of that shape and dtype to fill instead of a new one.

    Returns:
        ``out`` when given, else a new CPU tensor.
    """
    g = torch.Generator().manual_seed(seed)
    nbytes = rows * width * torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    result = raw.view(dtype).view(rows, width)
    if out is None:
        return result
    out.copy_(result)
    return out
