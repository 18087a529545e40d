"""CPU tests of build_read_table: Triton kernel (interpreter) and dispatch vs the reference."""

from __future__ import annotations

import pytest
import torch

from embcache.kernels import build_read_table, build_read_table_reference


def _inputs(bs: int, seed: int, out_dtype: torch.dtype = torch.int64):
    g = torch.Generator().manual_seed(seed)
    v2p = torch.randint(-1, 500, (400,), generator=g)
    vpage_table = torch.randint(-1, 410, (20, 33), generator=g)  # some ids out of v2p
    rows = torch.randint(0, 20, (bs,), generator=g)
    lengths = torch.randint(0, 40 * 16, (bs,), generator=g)
    if bs:
        lengths[0] = 0
        lengths[-1] = 10_000  # more pages than the table holds: clamped
    out = torch.full((bs, 30), -7, dtype=out_dtype)
    return vpage_table, rows, lengths, v2p, out


@pytest.mark.parametrize("bs", [0, 1, 7])
@pytest.mark.parametrize("out_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize(("target_blocks", "block_cols"), [(1024, 128), (3, 4), (1, 2)])
def test_matches_reference(interpret: None, bs, out_dtype, target_blocks, block_cols) -> None:
    vpage_table, rows, lengths, v2p, out = _inputs(bs, bs + block_cols, out_dtype)
    expected = out.clone()
    build_read_table_reference(vpage_table, rows, lengths, v2p, expected, 16)
    build_read_table(
        vpage_table, rows, lengths, v2p, out, 16, target_blocks=target_blocks, block_cols=block_cols
    )
    assert torch.equal(out, expected)


def test_reference_without_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    vpage_table, rows, lengths, v2p, out = _inputs(5, 1)
    expected = out.clone()
    build_read_table_reference(vpage_table, rows, lengths, v2p, expected, 16)
    build_read_table(vpage_table, rows, lengths, v2p, out, 16)
    assert torch.equal(out, expected)
    assert int((out[0] == -7).sum()) == 30  # length 0: untouched


def test_spec_example() -> None:
    v2p = torch.tensor([7, 8, 9, -1, 5], dtype=torch.int64)
    vpage_table = torch.tensor([[0, 1, 2, 3], [4, 3, 2, 1]])
    out = torch.full((2, 4), -9, dtype=torch.int64)
    build_read_table_reference(vpage_table, torch.tensor([1, 0]), torch.tensor([9, 5]), v2p, out, 4)
    assert out.tolist() == [[5, -1, 9, -9], [7, 8, -9, -9]]


@pytest.mark.parametrize(
    ("change", "arg"),
    [
        ({"rows": torch.tensor([0, 20])}, "rows"),
        ({"rows": torch.tensor([0, -1])}, "rows"),
        ({"rows": torch.tensor([0])}, "lengths"),
        ({"lengths": torch.tensor([1, -1])}, "lengths"),
        ({"lengths": torch.tensor([1.0, 2.0])}, "lengths"),
        ({"v2p": torch.zeros(4, dtype=torch.int32)}, "v2p"),
        ({"out": torch.zeros(3, 30, dtype=torch.int64)}, "out"),
        ({"out": torch.zeros(30, 2, dtype=torch.int64).t()}, "out"),
        ({"vpage_table": torch.zeros(5, dtype=torch.int64)}, "vpage_table"),
        ({"page_size": 0}, "page_size"),
        ({"page_size": 4.0}, "page_size"),
    ],
)
def test_validation(change: dict, arg: str) -> None:
    vpage_table, rows, lengths, v2p, out = _inputs(2, 3)
    kwargs = {"vpage_table": vpage_table, "rows": rows, "lengths": lengths, "v2p": v2p}
    kwargs |= {"out": out, "page_size": 16} | change
    with pytest.raises(ValueError, match=f"^{arg}:"):
        build_read_table(**kwargs)
