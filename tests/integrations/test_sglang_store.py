"""EmbCacheEmbeddingStore through SGLang 0.5.23's real factory, against a real daemon.

The pools are CPU tensors registered with ``register_buffer``; items are spread over
several page runs of them, as SGLang's ``EmbeddingCacheController`` hands them over.
"""

from __future__ import annotations

import importlib.util
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

if importlib.util.find_spec("sglang") is None:  # pragma: no cover - CI installs it
    pytest.skip("sglang is not installed (scripts/install_engines.sh)", allow_module_level=True)

with warnings.catch_warnings():  # only the torch.jit deprecations of SGLang's imports
    warnings.filterwarnings("ignore", r"`torch\.jit\.", DeprecationWarning)
    from sglang.srt.mem_cache.embedding_store import EmbeddingStore, EmbeddingStoreFactory

from embcache.errors import InvalidArgument
from embcache.integrations.sglang import register

PAGE_TOKENS, DIM = 4, 16
PAGE_BYTES = PAGE_TOKENS * DIM * 2  # bfloat16


@pytest.fixture
def store(daemon: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.setenv("EMBCACHE_SGLANG_TARGET", daemon.unix_target)
    monkeypatch.setenv("EMBCACHE_SGLANG_NAMESPACE", f"t-{uuid.uuid4().hex[:12]}")
    register()
    register()  # a second registration is skipped, not an error
    backend = EmbeddingStoreFactory.create_backend("embcache")
    yield backend
    backend.close()


def pool(pages: int) -> torch.Tensor:
    """A host pool like SGLang's: pages of PAGE_TOKENS rows of DIM bfloat16 values."""
    return torch.zeros(pages * PAGE_TOKENS, DIM, dtype=torch.bfloat16)


def runs(
    tensor: torch.Tensor, pages: list[tuple[int, int]], tokens: int
) -> tuple[list[int], list[int]]:
    """Pointers and sizes of ``tokens`` rows laid over page runs (start, length)."""
    ptrs, sizes, left = [], [], tokens
    for start, length in pages:
        n = min(length * PAGE_TOKENS, left)
        ptrs.append(tensor[start * PAGE_TOKENS].data_ptr())
        sizes.append(n * DIM * 2)
        left -= n
    assert left == 0
    return ptrs, sizes


def gather(tensor: torch.Tensor, pages: list[tuple[int, int]], tokens: int) -> torch.Tensor:
    rows = [tensor[s * PAGE_TOKENS : (s + n) * PAGE_TOKENS] for s, n in pages]
    return torch.cat(rows)[:tokens]


def test_factory_creates_the_backend(store: Any) -> None:
    assert isinstance(store, EmbeddingStore)
    assert type(store).__name__ == "EmbCacheEmbeddingStore"
    assert store.get_key("abc").startswith("sglang/t-") and store.get_key("abc").endswith("/abc")


def test_all_five_methods_over_page_runs(store: Any) -> None:
    src, dst = pool(32), pool(32)
    store.register_buffer(src)
    store.register_buffer(dst)
    store.register_buffer(src)  # the same buffer again: accepted
    src.copy_(torch.randn(src.shape).to(torch.bfloat16))

    # Multi-buffer put: item "a" over three runs (10 tokens), "b" over two (7 tokens).
    layout = {"a": ([(1, 1), (5, 1), (9, 1)], 10), "b": ([(12, 1), (20, 2)], 7)}
    hashes = list(layout)
    pp = [runs(src, p, t) for p, t in layout.values()]
    assert store.batch_put_from_multi_buffers(hashes, [p for p, _ in pp], [s for _, s in pp]) == [
        True,
        True,
    ]
    assert store.batch_is_exist(["a", "b", "zz"]) == [True, True, False]

    # Multi-buffer get into other runs of another pool.
    out_layout = {"a": ([(3, 2), (7, 1)], 10), "b": ([(0, 1), (30, 1)], 7), "zz": ([(15, 1)], 4)}
    gp = [runs(dst, p, t) for p, t in out_layout.values()]
    got = store.batch_get_into_multi_buffers(
        list(out_layout), [p for p, _ in gp], [s for _, s in gp]
    )
    assert got == [True, True, False]
    for h in ("a", "b"):
        assert torch.equal(gather(dst, *out_layout[h]), gather(src, *layout[h])), (
            f"{h}: bytes differ"
        )

    # Single-buffer put and get (one contiguous run each).
    ptr, size = runs(src, [(24, 2)], 8)
    assert store.batch_put(["c"], ptr, size) == [True]
    assert store.batch_put(["c"], ptr, size) == [True]  # already stored: still True
    dptr, dsize = runs(dst, [(26, 2)], 8)
    assert store.batch_get(["c", "zz"], dptr + dptr, dsize + dsize) == [True, False]
    assert torch.equal(gather(dst, [(26, 2)], 8), gather(src, [(24, 2)], 8))


def test_size_mismatch_is_a_miss(store: Any) -> None:
    src, dst = pool(8), pool(8)
    store.register_buffer(src)
    store.register_buffer(dst)
    src.fill_(1)
    ptr, size = runs(src, [(0, 2)], 8)
    assert store.batch_put(["m"], ptr, size) == [True]
    before = dst.clone()
    short_ptr, short_size = runs(dst, [(0, 1)], 4)
    assert store.batch_get(["m"], short_ptr, short_size) == [False]
    assert torch.equal(dst, before)  # nothing written on a miss


def test_unregistered_memory_is_refused_and_nothing_stored(store: Any) -> None:
    registered, stray = pool(4), pool(4)
    store.register_buffer(registered)
    good = runs(registered, [(0, 1)], 4)
    bad = runs(stray, [(0, 1)], 4)
    with pytest.raises(InvalidArgument, match="registered"):
        store.batch_put_from_multi_buffers(["ok", "bad"], [good[0], bad[0]], [good[1], bad[1]])
    assert store.batch_is_exist(["ok", "bad"]) == [False, False]  # checked before any put
    with pytest.raises(InvalidArgument, match="registered"):
        store.batch_get(["ok"], [registered.data_ptr() + PAGE_BYTES * 4 - 2], [4])  # runs off
    with pytest.raises(InvalidArgument, match="length"):
        store.batch_put(["x", "y"], good[0], good[1])
    with pytest.raises(InvalidArgument, match="overlaps"):
        store.register_buffer(registered[1:])
    with pytest.raises(InvalidArgument, match="CPU"):
        store.register_buffer([1, 2])  # type: ignore[arg-type]


def test_no_target_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EMBCACHE_SGLANG_TARGET", raising=False)
    register()
    with pytest.raises(InvalidArgument, match="EMBCACHE_SGLANG_TARGET"):
        EmbeddingStoreFactory.create_backend("embcache")
