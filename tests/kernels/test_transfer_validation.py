"""Every invalid plan raises ValueError naming the argument, and writes nothing."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from embcache.kernels import TransferConfig, transfer_ranges
from embcache.kernels.testing import bits, random_rows


def _src_dst() -> tuple[torch.Tensor, torch.Tensor]:
    return random_rows(10, 4, torch.float32, 1), random_rows(12, 4, torch.float32, 2)


GOOD = ([0, 5], [0, 6], [3, 4])


@pytest.mark.parametrize(
    ("change", "arg"),
    [
        ({"src_starts": [0, 7]}, "src_starts"),  # 7 + 4 > 10 rows
        ({"dst_starts": [0, 9]}, "dst_starts"),  # 9 + 4 > 12 rows
        ({"src_starts": [-1, 5]}, "src_starts"),
        ({"dst_starts": [0, -6]}, "dst_starts"),
        ({"lengths": [3, -1]}, "lengths"),
        ({"lengths": [3, 4, 1]}, "lengths"),  # unequal list lengths
        ({"dst_starts": [0, 2]}, "dst_starts"),  # [0, 3) and [2, 6) overlap
        ({"dst_starts": [4, 4], "lengths": [1, 1]}, "dst_starts"),  # same row twice
        ({"src_starts": [0.0, 5.0]}, "src_starts"),
        ({"src_starts": [True, 5]}, "src_starts"),
        ({"src_starts": np.zeros((2, 1), dtype=np.int64)}, "src_starts"),
        ({"lengths": torch.tensor([3.0, 4.0])}, "lengths"),
        ({"lengths": "3,4"}, "lengths"),
        ({"src_starts": [2**70, 0]}, "src_starts"),
        ({"src_starts": [2**62, 0]}, "src_starts"),  # huge start: no int64 overflow
        ({"lengths": [3, 2**62]}, "src_starts"),
        ({"backend": "fast"}, "backend"),
        ({"backend": "batch"}, "backend"),  # needs a CUDA tensor
        ({"backend": "memcpy"}, "backend"),
        ({"config": {"sm_budget": 4}}, "config"),
    ],
)
def test_bad_plan_raises_and_writes_nothing(change: dict, arg: str) -> None:
    src, dst = _src_dst()
    before = dst.clone()
    kwargs: dict = dict(zip(("src_starts", "dst_starts", "lengths"), GOOD, strict=True))
    kwargs.update(change)
    with pytest.raises(ValueError, match=f"^{arg}:"):
        transfer_ranges(src, dst, **kwargs)
    assert torch.equal(bits(dst), bits(before))


def test_overlap_after_a_good_range_writes_nothing() -> None:
    """Validation is whole-plan: a bad last range must not let the first ones through."""
    src, dst = _src_dst()
    before = dst.clone()
    with pytest.raises(ValueError, match=r"^dst_starts:"):
        transfer_ranges(src, dst, [0, 1, 2], [0, 5, 7], [2, 3, 1])  # [5, 8) and [7, 8)
    assert torch.equal(bits(dst), bits(before))


@pytest.mark.parametrize(
    ("make", "arg"),
    [
        (lambda s, d: (s.double(), d), "dst"),  # dtype mismatch
        (lambda s, d: (s, d[:, :3]), "dst"),  # width mismatch (and not contiguous)
        (lambda s, d: (s, d.t().contiguous()[:4].t()), "dst"),
        (lambda s, d: (s[:, ::2], d), "src"),  # not contiguous
        (lambda s, d: (s.reshape(-1), d), "src"),  # 1-D
        (lambda s, d: (s.numpy(), d), "src"),
        (lambda s, d: (s, d.reshape(2, 6, 4)), "dst"),
        (lambda s, d: (d[:10], d), "dst"),  # src and dst share memory
    ],
)
def test_bad_tensors(make, arg: str) -> None:
    src, dst = _src_dst()
    src, dst = make(src, dst)
    with pytest.raises(ValueError, match=f"^{arg}:"):
        transfer_ranges(src, dst, *GOOD)


def test_width_mismatch_message() -> None:
    src = random_rows(10, 4, torch.float32, 1)
    dst = random_rows(12, 5, torch.float32, 2)
    with pytest.raises(ValueError, match=r"^dst: row width 5"):
        transfer_ranges(src, dst, *GOOD)


def test_stream_rejected_on_cpu() -> None:
    src, dst = _src_dst()
    with pytest.raises(ValueError, match=r"^stream:"):
        transfer_ranges(src, dst, *GOOD, stream=object())  # type: ignore[arg-type]


def test_kernel_backend_on_cpu_needs_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    src, dst = _src_dst()
    with pytest.raises(ValueError, match=r"^backend:"):
        transfer_ranges(src, dst, *GOOD, backend="kernel")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("sm_budget", 0),
        ("num_warps", 3),
        ("tile_bytes", 0),
        ("chunk_bytes", -1),
        ("split_kernel_fraction", 1.5),
        ("kernel_below_bytes", 1 << 40),
        ("batch_first_call", -1),
    ],
)
def test_config_validation(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        TransferConfig(**{field: value})


@pytest.mark.parametrize(
    ("count", "first"),
    [(0, 16), (1, 16), (16, 16), (17, 16), (256, 16), (257, 1), (300, 0), (5, 2)],
)
def test_batch_call_slices_cover_the_ranges_in_order(count: int, first: int) -> None:
    from embcache.kernels._copy_engine import call_slices

    parts = call_slices(count, first)
    assert [i for p in parts for i in range(count)[p]] == list(range(count))
    sizes = [len(range(count)[p]) for p in parts]
    if first and count > first:
        assert sizes[0] == first
        assert all(b == 2 * a for a, b in itertools.pairwise(sizes[:-1]))
    else:
        assert len(parts) == 1


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.tuples(st.integers(-2, 20), st.integers(-2, 20), st.integers(-1, 8)), max_size=8)
)
def test_short_and_long_plan_checks_agree(ranges: list[tuple[int, int, int]]) -> None:
    """Plans up to 64 ranges are checked in Python, longer ones with numpy: same verdicts."""
    from embcache.kernels._plan import _check_ranges, _check_ranges_small

    cols = [np.array([r[i] for r in ranges], dtype=np.int64) for i in range(3)]
    verdicts = []
    for check in (_check_ranges, _check_ranges_small):
        try:
            verdicts.append([a.tolist() for a in check(*cols, 16, 18)])
        except ValueError as exc:
            verdicts.append(str(exc).split(":")[0])
    assert verdicts[0] == verdicts[1]
