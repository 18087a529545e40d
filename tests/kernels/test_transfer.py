"""CPU tests of transfer_ranges: torch loop and Triton kernel (interpreter) vs the reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from embcache.kernels import (
    TransferConfig,
    transfer_planned,
    transfer_ranges,
    transfer_ranges_reference,
)
from embcache.kernels.testing import bits, random_plan, random_rows
from embcache.kernels.transfer import choose_backend

DTYPE_WIDTHS = [
    (torch.bfloat16, 64),  # 128-byte rows: 8-byte accesses
    (torch.bfloat16, 37),  # 74-byte rows: 2-byte accesses
    (torch.float16, 6),
    (torch.float32, 5),
    (torch.int8, 3),
    (torch.int8, 74),
]


def _check(backend: str, src, dst, plan, **kwargs) -> str:
    expected = dst.clone()
    transfer_ranges_reference(src, expected, *plan)
    used = transfer_ranges(src, dst, *plan, backend=backend, **kwargs)
    assert torch.equal(bits(dst), bits(expected))
    return used


@pytest.mark.parametrize(("dtype", "width"), DTYPE_WIDTHS)
def test_torch_backend_matches_reference(dtype: torch.dtype, width: int) -> None:
    rng = np.random.default_rng(width)
    src, dst = random_rows(64, width, dtype, 1), random_rows(80, width, dtype, 2)
    plan = random_plan(rng, 64, 80, 7, 9, zero_ranges=True)
    assert _check("auto", src, dst, plan) == "torch"


@pytest.mark.parametrize(("dtype", "width"), DTYPE_WIDTHS)
@pytest.mark.parametrize("short_last", [False, True])
def test_kernel_matches_reference(interpret: None, dtype, width, short_last: bool) -> None:
    rng = np.random.default_rng(width + short_last)
    src, dst = random_rows(64, width, dtype, 3), random_rows(80, width, dtype, 4)
    plan = random_plan(rng, 64, 80, 6, 10, short_last=short_last)
    assert _check("kernel", src, dst, plan) == "kernel"


@pytest.mark.parametrize(
    "config",
    [
        TransferConfig(sm_budget=1, tile_bytes=64, chunk_bytes=16),  # many tiles per program
        TransferConfig(sm_budget=3, tile_bytes=256, chunk_bytes=32),  # runs cut into chunks
        TransferConfig(sm_budget=16, num_warps=4),
    ],
)
def test_kernel_configs_split_runs_into_chunks(interpret: None, config: TransferConfig) -> None:
    rng = np.random.default_rng(5)
    src, dst = random_rows(90, 12, torch.float32, 5), random_rows(100, 12, torch.float32, 6)
    plan = random_plan(rng, 90, 100, 5, 19)
    _check("kernel", src, dst, plan, config=config)


def test_kernel_unaligned_views(interpret: None) -> None:
    """Row views that start at odd addresses force 1-byte accesses."""
    base_src = random_rows(41, 5, torch.int8, 7)
    base_dst = random_rows(41, 5, torch.int8, 8)
    src, dst = base_src[1:], base_dst[3:]  # 5- and 15-byte offsets
    plan = ([0, 10, 30], [20, 0, 33], [9, 10, 5])
    _check("kernel", src, dst, plan)


def test_index_inputs_lists_arrays_tensors() -> None:
    src, dst = random_rows(10, 4, torch.float32, 9), random_rows(10, 4, torch.float32, 10)
    for plan in (
        ([1, 5], [0, 4], [2, 3]),
        (np.array([1, 5]), np.array([0, 4], dtype=np.int32), np.array([2, 3], dtype=np.uint8)),
        (torch.tensor([1, 5]), torch.tensor([0, 4]), torch.tensor([2, 3], dtype=torch.int32)),
    ):
        _check("torch", src, dst, plan)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_empty_plans_are_noops(backend: str) -> None:
    src, dst = random_rows(4, 3, torch.float16, 11), random_rows(4, 3, torch.float16, 12)
    before = dst.clone()
    assert transfer_ranges(src, dst, [], [], [], backend=backend) == "none"
    assert transfer_ranges(src, dst, [1, 2], [0, 3], [0, 0], backend=backend) == "none"
    assert transfer_ranges(src[:0], dst[:0], [0], [0], [0], backend=backend) == "none"
    assert torch.equal(bits(dst), bits(before))


def test_zero_width_rows() -> None:
    src, dst = torch.empty(5, 0), torch.empty(5, 0)
    assert transfer_ranges(src, dst, [0], [1], [4]) == "none"


def test_kernel_empty_plan(interpret: None) -> None:
    src, dst = random_rows(4, 3, torch.float16, 13), random_rows(4, 3, torch.float16, 14)
    assert transfer_ranges(src, dst, [], [], [], backend="kernel") == "none"


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    width=st.integers(1, 20),
    dtype=st.sampled_from([torch.int8, torch.float16, torch.bfloat16, torch.float32]),
    num_ranges=st.integers(0, 6),
    max_len=st.integers(1, 6),
)
def test_random_plans_torch(seed, width, dtype, num_ranges, max_len) -> None:
    rng = np.random.default_rng(seed)
    src = random_rows(40, width, dtype, seed % 1000)
    dst = random_rows(40, width, dtype, seed % 1000 + 1)
    _check("torch", src, dst, random_plan(rng, 40, 40, num_ranges, max_len, zero_ranges=True))


def test_random_plans_kernel(interpret: None) -> None:
    @settings(max_examples=8, deadline=None)
    @given(
        seed=st.integers(0, 2**32 - 1),
        width=st.integers(1, 9),
        dtype=st.sampled_from([torch.int8, torch.bfloat16, torch.float32]),
        num_ranges=st.integers(1, 5),
        max_len=st.integers(1, 5),
    )
    def run(seed, width, dtype, num_ranges, max_len) -> None:
        rng = np.random.default_rng(seed)
        src = random_rows(30, width, dtype, seed % 1000)
        dst = random_rows(30, width, dtype, seed % 1000 + 1)
        plan = random_plan(rng, 30, 30, num_ranges, max_len, zero_ranges=True)
        _check("kernel", src, dst, plan)

    run()


KIB = 1024


@pytest.mark.parametrize(
    ("num_ranges", "total", "has_batch", "expected"),
    [
        (1, 64 * KIB * KIB, True, "memcpy"),
        (8192, 8192 * 8 * KIB, True, "kernel"),
        (2048, 2048 * 32 * KIB, True, "kernel"),
        (512, 512 * 128 * KIB, True, "batch"),
        (512, 512 * 127 * KIB, True, "kernel"),
        (512, 512 * 127 * KIB, False, "kernel"),
        (32, 32 * 2 * KIB * KIB, True, "batch"),
        (32, 32 * 2 * KIB * KIB, False, "memcpy"),
    ],
)
def test_auto_rules(num_ranges: int, total: int, has_batch: bool, expected: str) -> None:
    config = TransferConfig()
    assert choose_backend(num_ranges, total, config, has_batch=has_batch) == expected


def test_auto_rules_are_overridable() -> None:
    config = TransferConfig(kernel_below_bytes=0, copy_engine_from_bytes=0)
    assert choose_backend(100, 100 * 8 * KIB, config, has_batch=True) == "batch"
    split = TransferConfig(kernel_below_bytes=32 * KIB, copy_engine_from_bytes=512 * KIB)
    assert choose_backend(100, 100 * 128 * KIB, split, has_batch=True) == "split"
    assert choose_backend(100, 100 * 128 * KIB, split, has_batch=False) == "kernel"


@pytest.mark.parametrize(
    ("row_bytes", "pointers", "widest", "expected"),
    [(8192, (4096, 64), 16, 16), (8192, (4096, 64), 8, 8), (74, (64,), 16, 2), (96, (8,), 16, 8)],
)
def test_element_bytes(row_bytes: int, pointers: tuple, widest: int, expected: int) -> None:
    from embcache.kernels._plan import TransferPlan

    empty = np.zeros(0, dtype=np.int64)
    plan = TransferPlan(torch.empty(0, 1), torch.empty(0, 1), empty, empty, empty, row_bytes, "cpu")
    assert plan.element_bytes(*pointers, widest=widest) == expected


def test_chunk_descriptors_cut_long_runs() -> None:
    from embcache.kernels._triton_copy import chunk_descriptors

    desc = chunk_descriptors(np.array([0, 100]), np.array([50, 0]), np.array([10, 3]), 4)
    assert desc.tolist() == [[0, 4, 8, 100], [50, 54, 58, 0], [4, 4, 2, 3]]
    short = chunk_descriptors(np.array([7]), np.array([9]), np.array([3]), 4)
    assert short.tolist() == [[7], [9], [3]]


@pytest.mark.parametrize("backend", ["auto", "kernel"])
@pytest.mark.parametrize(("dtype", "width"), DTYPE_WIDTHS)
def test_planned_plans_match_the_reference(interpret: None, backend, dtype, width) -> None:
    """transfer_planned (no checks) copies a valid plan as transfer_ranges does: int64
    arrays, no empty ranges, destinations disjoint; an empty plan is a no-op."""
    rng = np.random.default_rng(width + 7)
    src, dst = random_rows(64, width, dtype, 7), random_rows(80, width, dtype, 8)
    plan = tuple(np.asarray(x, dtype=np.int64) for x in random_plan(rng, 64, 80, 6, 10))
    expected = dst.clone()
    transfer_ranges_reference(src, expected, *plan)
    used = transfer_planned(src, dst, *plan, backend=backend)
    assert used == ("torch" if backend == "auto" else "kernel")
    assert torch.equal(bits(dst), bits(expected))
    empty = np.zeros(0, dtype=np.int64)
    assert transfer_planned(src, dst, empty, empty, empty) == "none"
    assert torch.equal(bits(dst), bits(expected))
