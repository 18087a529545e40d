"""The SGLang store on the daemon's node: ``batch_is_exist`` and the ``batch_get*`` calls
read the daemon's read table with no call and no lease, copy the right bytes into the
registered page runs, and an entry evicted meanwhile or a pool that cannot be mapped goes
through calls as before (docs/integrations.md).

The daemon's counters say what reached it: a read from the table counts in ``hits`` and
``read_table.reads``, a hit through a call in ``hits`` only, a miss through a call in
``misses``.
"""

from __future__ import annotations

import importlib.util
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

if importlib.util.find_spec("sglang") is None:  # pragma: no cover - CI installs it
    pytest.skip("sglang is not installed (scripts/install_engines.sh)", allow_module_level=True)

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", r"`torch\.jit\.", DeprecationWarning)
    from sglang.srt.mem_cache.embedding_store import EmbeddingStoreFactory

from embcache.clients import EmbCacheClient
from embcache.clients._sync.connection import Connection
from embcache.clients._sync.stateless_calls import StatelessCalls
from embcache.clients.device import read_table as client_table
from embcache.integrations.sglang import register
from embcache.service.daemon_process import DaemonProcess

PAGE_TOKENS, DIM = 4, 16
PAGE_BYTES = PAGE_TOKENS * DIM * 2  # bfloat16
pytestmark = pytest.mark.skipif(not client_table.ORDERED_STORES, reason="x86-64 only")


@pytest.fixture
def daemon() -> Iterator[DaemonProcess]:
    """A daemon of this test only (the process-wide mappings then belong to it alone)."""
    with tempfile.TemporaryDirectory(prefix="embcache-st-") as folder:
        proc = DaemonProcess(
            [
                "--grpc-socket",
                str(Path(folder) / "d.sock"),
                "--host-pool-bytes",
                "32MiB",
                "--shm-name",
                f"embcache-st-{uuid.uuid4().hex[:10]}",
            ]
        )
        try:
            yield proc
        finally:
            proc.stop()


@pytest.fixture
def store(daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.setenv("EMBCACHE_SGLANG_TARGET", daemon.unix_target)
    monkeypatch.setenv("EMBCACHE_SGLANG_NAMESPACE", f"t-{uuid.uuid4().hex[:12]}")
    register()
    backend = EmbeddingStoreFactory.create_backend("embcache")
    yield backend
    backend.close()


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Every pin, get_bytes and non-empty release made through a client of this process."""
    seen: dict[str, int] = {}

    def counting(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            if name != "release" or (args and list(args[0])):
                seen[name] = seen.get(name, 0) + 1
            return real(self, *args, **kwargs)

        return call

    # Each where the call is made: releases of leased tensors and reads of bytes come from
    # the client's parts, not through its public methods.
    owners = {"release": Connection, "renew": StatelessCalls, "get_bytes": StatelessCalls}
    for name in ("pin", "release", "get_bytes"):
        owner = owners.get(name, EmbCacheClient)
        monkeypatch.setattr(owner, name, counting(name, getattr(owner, name)))
    return seen


def pool(pages: int) -> torch.Tensor:
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


def counters(client: EmbCacheClient) -> dict[str, int]:
    s = client.stats()
    return {
        "hits": s["hits"],
        "misses": s["misses"],
        "table_reads": s["read_table"]["reads"],
        "leases_active": s["leases_active"],
    }


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def filled(store: Any) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """Two registered pools, and items "a" (10 tokens over 3 runs) and "b" (7 over 2) put
    from the first; returns (src, dst, layout of each item in dst)."""
    src, dst = pool(32), pool(32)
    store.register_buffer(src)
    store.register_buffer(dst)
    src.copy_(torch.randn(src.shape).to(torch.bfloat16))
    put = {"a": ([(0, 1), (5, 1), (9, 1)], 10), "b": ([(2, 2)], 7)}
    ptrs, sizes = zip(*(runs(src, p, n) for p, n in put.values()), strict=True)
    assert store.batch_put_from_multi_buffers(list(put), list(ptrs), list(sizes)) == [True] * 2
    layout = {"a": ([(20, 1), (12, 2)], 10), "b": ([(30, 2)], 7)}
    for name, (pages, n) in put.items():
        layout[name] += (gather(src, pages, n).clone(),)  # type: ignore[assignment]
    return src, dst, layout


def test_gets_and_exists_make_no_call(
    store: Any, daemon: DaemonProcess, calls: dict[str, int]
) -> None:
    _, dst, layout = filled(store)
    with EmbCacheClient(daemon.unix_target) as probe:
        before = counters(probe)
        assert store.batch_is_exist(["a", "b"]) == [True, True]
        ptrs, sizes = zip(*(runs(dst, p, n) for p, n, _ in layout.values()), strict=True)
        assert store.batch_get_into_multi_buffers(["a", "b"], list(ptrs), list(sizes)) == [
            True,
            True,
        ]
        for pages, n, truth in layout.values():
            assert torch.equal(gather(dst, pages, n), truth)
        # batch_get: one contiguous destination per item
        dst.zero_()
        one = {"a": (0, 10), "b": (16, 7)}
        got = store.batch_get(
            list(one),
            [dst[row].data_ptr() for row, _ in one.values()],
            [n * DIM * 2 for _, n in one.values()],
        )
        assert got == [True, True]
        for name, (row, n) in one.items():
            assert torch.equal(dst[row : row + n], layout[name][2])
        assert calls == {}
        wait_for(lambda: counters(probe)["table_reads"] > before["table_reads"])
        after = counters(probe)
        # every hit came from the table: none was a call
        assert after["hits"] - after["table_reads"] == before["hits"] - before["table_reads"]
        assert after["misses"] == before["misses"] and after["leases_active"] == 0


def test_an_evicted_item_is_a_clean_miss(store: Any, daemon: DaemonProcess) -> None:
    """Evicted after batch_is_exist said yes: the get asks the daemon, the item is a miss
    and its page runs are left as they were; the other item is still copied whole."""
    _, dst, layout = filled(store)
    assert store.batch_is_exist(["a", "b"]) == [True, True]
    with EmbCacheClient(daemon.unix_target) as admin:
        assert admin.evict([store.get_key("a")]) == ["evicted"]
    dst.fill_(7)
    ptrs, sizes = zip(*(runs(dst, p, n) for p, n, _ in layout.values()), strict=True)
    assert store.batch_get_into_multi_buffers(["a", "b"], list(ptrs), list(sizes)) == [
        False,
        True,
    ]
    pages, n, _ = layout["a"]
    assert bool((gather(dst, pages, n) == 7).all())
    pages, n, truth = layout["b"]
    assert torch.equal(gather(dst, pages, n), truth)
    assert store.batch_is_exist(["a", "b"]) == [False, True]


def test_a_pool_that_cannot_be_mapped_goes_through_calls(
    daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A remote-like store (the pool's boot id is another machine's): no table is read,
    and the calls still give the right bytes."""
    import embcache.clients.device.shm as shm

    monkeypatch.setattr(shm, "boot_id", lambda: "another-node")
    monkeypatch.setenv("EMBCACHE_SGLANG_TARGET", daemon.unix_target)
    monkeypatch.setenv("EMBCACHE_SGLANG_NAMESPACE", f"t-{uuid.uuid4().hex[:12]}")
    register()
    remote = EmbeddingStoreFactory.create_backend("embcache")
    try:
        _, dst, layout = filled(remote)
        with EmbCacheClient(daemon.unix_target) as probe:
            before = counters(probe)
            assert remote.batch_is_exist(["a", "b", "zz"]) == [True, True, False]
            ptrs, sizes = zip(*(runs(dst, p, n) for p, n, _ in layout.values()), strict=True)
            assert remote.batch_get_into_multi_buffers(["a", "b"], list(ptrs), list(sizes)) == [
                True,
                True,
            ]
            for pages, n, truth in layout.values():
                assert torch.equal(gather(dst, pages, n), truth)
            after = counters(probe)
            assert after["table_reads"] == before["table_reads"]
            assert after["hits"] >= before["hits"] + 2  # answered by calls
    finally:
        remote.close()
