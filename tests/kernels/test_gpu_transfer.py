"""GPU tests of transfer_ranges (H200): every backend, both directions, bit-exact."""

from __future__ import annotations

import gc
from multiprocessing import shared_memory

import numpy as np
import pytest
import torch

from embcache.kernels import (
    TransferConfig,
    choose_backend,
    register_host_memory,
    transfer_ranges,
    transfer_ranges_reference,
)
from embcache.kernels._cudart import runtime
from embcache.kernels.testing import bits, random_plan, random_rows

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BACKENDS = ["kernel", "batch", "memcpy", "torch", "auto"]
DTYPE_WIDTHS = [
    (torch.bfloat16, 4096),  # 8 KiB rows
    (torch.bfloat16, 37),  # 74-byte rows
    (torch.float16, 100),
    (torch.float32, 33),
    (torch.int8, 74),
    (torch.int8, 3),
]


def _pinned(rows: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return random_rows(
        rows, width, dtype, seed, out=torch.empty((rows, width), dtype=dtype, pin_memory=True)
    )


def _pair(direction: str, src_rows: int, dst_rows: int, width: int, dtype, seed: int):
    """Poisoned (random-byte) source and destination, host side pinned."""
    if direction == "h2d":
        return _pinned(src_rows, width, dtype, seed), random_rows(
            dst_rows, width, dtype, seed + 1
        ).cuda()
    return random_rows(src_rows, width, dtype, seed).cuda(), _pinned(
        dst_rows, width, dtype, seed + 1
    )


def _run_and_check(src, dst, plan, **kwargs) -> str:
    expected = dst.cpu().clone()
    transfer_ranges_reference(src.cpu(), expected, *plan)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    used = transfer_ranges(src, dst, *plan, stream=kwargs.pop("stream", stream), **kwargs)
    torch.cuda.synchronize()
    assert torch.equal(bits(dst.cpu()), bits(expected))
    return used


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("dtype", "width"), DTYPE_WIDTHS)
def test_small_fragmented_plans(direction, backend, dtype, width) -> None:
    rng = np.random.default_rng(width)
    src, dst = _pair(direction, 700, 600, width, dtype, width)
    plan = random_plan(rng, 700, 600, 40, 12, short_last=True)
    _run_and_check(src, dst, plan, backend=backend)


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("run_rows", [1, 16])  # 8 KiB and 128 KiB runs
def test_large_fragmented_plans(direction: str, backend: str, run_rows: int) -> None:
    rng = np.random.default_rng(run_rows)
    num_ranges = 2048 // run_rows
    src, dst = _pair(direction, 4096, 4096, 4096, torch.bfloat16, run_rows)
    plan = random_plan(rng, 4096, 4096, num_ranges, run_rows, short_last=True)
    used = _run_and_check(src, dst, plan, backend=backend)
    rt = runtime()
    if backend == "auto" and rt is not None:
        # the short last range pulls the mean run of the 128 KiB plan under the threshold
        total = int(plan[2].sum()) * 8192
        expected = choose_backend(len(plan[2]), total, TransferConfig(), has_batch=rt.has_batch)
        assert used == expected == "kernel"


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize(
    "config",
    [
        TransferConfig(sm_budget=1),
        TransferConfig(sm_budget=132, tile_bytes=8192),
        TransferConfig(sm_budget=16, tile_bytes=64 * 1024, num_warps=4),
        TransferConfig(kernel_below_bytes=0, split_kernel_fraction=1.0),
        TransferConfig(kernel_below_bytes=0, copy_engine_from_bytes=1 << 30),
        TransferConfig(kernel_below_bytes=0, split_kernel_fraction=0.0),
        TransferConfig(vector_host_stores=False, copy_engine_streams=3),
        TransferConfig(vector_device=False, vector_host_loads=False, copy_engine_streams=2),
        TransferConfig(batch_first_call=1),  # 1, 2, 4, ... ranges per batch call
        TransferConfig(batch_first_call=0),  # one call
    ],
)
def test_kernel_configs(direction: str, config: TransferConfig) -> None:
    rng = np.random.default_rng(7)
    src, dst = _pair(direction, 1024, 1024, 512, torch.float16, 7)
    plan = random_plan(rng, 1024, 1024, 50, 15)
    for backend in ("kernel", "auto", "batch"):
        _run_and_check(src, dst, plan, backend=backend, config=config)


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("backend", ["batch", "kernel", "auto"])
def test_default_stream(direction: str, backend: str) -> None:
    """On the legacy default stream (batch needs a side stream there)."""
    rng = np.random.default_rng(3)
    src, dst = _pair(direction, 256, 256, 1024, torch.bfloat16, 3)
    plan = random_plan(rng, 256, 256, 20, 8)
    expected = dst.cpu().clone()
    transfer_ranges_reference(src.cpu(), expected, *plan)
    transfer_ranges(src, dst, *plan, backend=backend)
    torch.cuda.synchronize()
    assert torch.equal(bits(dst.cpu()), bits(expected))


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_contiguous_single_range_uses_copy_engine(direction: str) -> None:
    src, dst = _pair(direction, 512, 512, 4096, torch.bfloat16, 5)
    assert _run_and_check(src, dst, ([0], [0], [512])) == "memcpy"


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_plan(direction: str, backend: str) -> None:
    src, dst = _pair(direction, 8, 8, 16, torch.float32, 1)
    before = dst.cpu().clone()
    assert transfer_ranges(src, dst, [], [], [], backend=backend) == "none"
    assert transfer_ranges(src, dst, [3], [2], [0], backend=backend) == "none"
    torch.cuda.synchronize()
    assert torch.equal(bits(dst.cpu()), bits(before))


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("plan", "arg"),
    [
        (([0, 1, 2], [0, 5, 7], [2, 3, 1]), "dst_starts"),  # last range overlaps
        (([0, 60], [0, 10], [4, 5]), "src_starts"),  # runs past 64 rows
        (([0, 1], [0, 62], [1, 4]), "dst_starts"),
        (([0, 1], [0, 10], [1, -1]), "lengths"),
    ],
)
def test_invalid_plans_leave_dst_untouched(direction, backend, plan, arg) -> None:
    src, dst = _pair(direction, 64, 64, 40, torch.bfloat16, 11)
    before = dst.cpu().clone()
    with pytest.raises(ValueError, match=rf"^{arg}:"):
        transfer_ranges(src, dst, *plan, backend=backend)
    torch.cuda.synchronize()
    assert torch.equal(bits(dst.cpu()), bits(before))


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_pageable_host_memory_is_refused(direction: str) -> None:
    dev = torch.zeros(8, 4, device="cuda")
    host = torch.zeros(8, 4)
    src, dst, name = (host, dev, "src") if direction == "h2d" else (dev, host, "dst")
    with pytest.raises(ValueError, match=rf"^{name}: is pageable"):
        transfer_ranges(src, dst, [0], [0], [8])
    with pytest.raises(ValueError, match=rf"^{name}: is not page-locked"):
        transfer_ranges(src, dst, [0, 4], [0, 4], [2, 2], backend="kernel", host_registered=True)
    torch.cuda.synchronize()  # the failed runtime call left no error behind
    assert torch.count_nonzero(dst.cpu()) == 0


def test_device_to_device_is_refused() -> None:
    a, b = torch.zeros(4, 4, device="cuda"), torch.zeros(4, 4, device="cuda")
    with pytest.raises(ValueError, match=r"^dst:"):
        transfer_ranges(a, b, [0], [0], [1])


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_registered_shared_memory(direction: str, backend: str) -> None:
    """A POSIX shared-memory segment registered with cudaHostRegister, used at an offset."""
    rows, width, dtype = 512, 37, torch.bfloat16  # 74-byte rows
    nbytes = rows * width * 2
    shm = shared_memory.SharedMemory(create=True, size=nbytes + 4096)
    try:
        buf = torch.frombuffer(shm.buf, dtype=torch.uint8)
        with register_host_memory(buf) as reg:
            host = buf[1024 : 1024 + nbytes].view(dtype).view(rows, width)
            assert reg.contains(host)  # host.is_pinned() may say False: say so
            random_rows(rows, width, dtype, 21, out=host)
            dev = random_rows(rows, width, dtype, 22).cuda()
            src, dst = (host, dev) if direction == "h2d" else (dev, host)
            plan = random_plan(np.random.default_rng(2), rows, rows, 30, 9, short_last=True)
            _run_and_check(src, dst, plan, backend=backend, host_registered=True)
            del host, src, dst
        del buf
        gc.collect()
    finally:
        shm.unlink()
        shm.close()


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_ranges", [1, 40, 300])
def test_planned_plans_match_the_reference(direction: str, backend: str, num_ranges: int) -> None:
    """transfer_planned, the unchecked path a daemon's cold get takes: every backend, both
    directions, odd row size, bit for bit what transfer_ranges_reference writes."""
    from embcache.kernels import transfer_planned

    width = 37  # 74-byte rows: odd byte offsets and sizes
    rng = np.random.default_rng(num_ranges)
    src_rows, dst_rows = 4 * num_ranges + 50, 4 * num_ranges + 40
    src, dst = _pair(direction, src_rows, dst_rows, width, torch.bfloat16, num_ranges)
    plan = tuple(
        np.asarray(x, dtype=np.int64) for x in random_plan(rng, src_rows, dst_rows, num_ranges, 4)
    )
    expected = dst.cpu().clone()
    transfer_ranges_reference(src.cpu(), expected, *plan)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    transfer_planned(src, dst, *plan, stream=stream, backend=backend)
    stream.synchronize()
    assert torch.equal(bits(dst.cpu()), bits(expected))
