"""Copies into GPU memory out of this process's own read-only mapping of a host pool,
registered chunk by chunk (clients/device/registered.py, table_cuda.py): bit for bit against
the CPU copy of the same runs, into poisoned destinations; nothing queued, nothing written,
while the chunks read are not registered."""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from embcache.clients.device import registered, shm, table_cuda
from embcache.kernels import _cudart
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.proto.locations import boot_id

pytestmark = pytest.mark.gpu

MIB = 1 << 20
PAGE = 4096
CHUNK = MIB  # small chunks, so that runs cross them
SIZE = 24 * MIB + 3 * PAGE
POISON = 0xA5


@pytest.fixture(scope="module")
def mapping() -> Iterator[shm.PoolMapping]:
    name = f"embcache-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    path = Path("/dev/shm") / name
    gen = torch.Generator().manual_seed(7)
    data = torch.randint(0, 256, (SIZE,), dtype=torch.uint8, generator=gen)
    data[:8] = POISON  # a run of poison-valued bytes too
    path.write_bytes(data.numpy().tobytes())
    try:
        st = path.stat()
        desc = pb.HostShmPool(
            segment_name=name, size=SIZE, page_bytes=PAGE, boot_id=boot_id(),
            st_dev=st.st_dev, st_ino=st.st_ino,
        )  # fmt: skip
        m = shm.PoolMaps(path.parent).get(pb.PoolHandle(pool_id="p", host_shm=desc))
        assert m is not None
        yield m
    finally:
        path.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def reg(mapping: shm.PoolMapping) -> Iterator[registered.RegisteredPool]:
    r = registered.RegisteredPools(chunk_bytes=CHUNK).get(mapping)
    assert r is not None
    assert r.wait_registered(120), f"registration failed: {r.error} {r.stats()}"
    yield r
    r.close()


def expected(mapping: shm.PoolMapping, runs: list[tuple[int, int]]) -> torch.Tensor:
    out = table_cuda.copy_runs_to_host(mapping, runs)
    assert out is not None
    return out


def poisoned(nbytes: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    t = torch.full((nbytes,), POISON, dtype=torch.uint8, device="cuda")
    return t.view(dtype)


def scattered(count: int, run_bytes: int, last_bytes: int, seed: int) -> list[tuple[int, int]]:
    """``count`` runs at distinct page-aligned places, in a random order, the last one cut to
    ``last_bytes`` (an entry's last page run ends where the entry does)."""
    gen = torch.Generator().manual_seed(seed)
    slots = (SIZE - run_bytes) // run_bytes
    picks = torch.randperm(slots, generator=gen)[:count].tolist()
    runs = [(p * run_bytes + PAGE * (p % 3), run_bytes) for p in picks]
    runs[-1] = (runs[-1][0], last_bytes)
    return runs


def check_copy(
    mapping: shm.PoolMapping,
    reg: registered.RegisteredPool,
    runs: list[tuple[int, int]],
    dtype: torch.dtype = torch.uint8,
    stream: torch.cuda.Stream | None = None,
) -> None:
    nbytes = sum(n for _, n in runs)
    out = poisoned(nbytes, dtype)
    event = table_cuda.copy_runs_to_cuda(mapping, reg, runs, out, stream)
    assert event is not None
    event.synchronize()
    got = out.view(torch.uint8).cpu()
    assert torch.equal(got, expected(mapping, runs))


def test_read_only_registration_is_accepted(reg: registered.RegisteredPool) -> None:
    stats = reg.stats()
    assert reg.usable and stats["chunks_registered"] == stats["chunks_total"] == 25
    assert stats["bytes_registered"] == SIZE


@pytest.mark.parametrize(
    "runs",
    [
        [(0, 4 * MIB)],  # chunks 0-3
        [(CHUNK + PAGE, 300_001)],  # inside one chunk, odd length
        [(3 * CHUNK - 5, 11)],  # across a boundary
        [(SIZE - 777, 777)],  # the segment's last bytes
    ],
)
def test_one_run(mapping, reg, runs) -> None:  # type: ignore[no-untyped-def]
    check_copy(mapping, reg, runs)


@pytest.mark.parametrize(
    ("count", "run_bytes", "last_bytes"),
    [
        (16, MIB, MIB),  # large runs: copy engine
        (16, MIB, MIB - 3),  # odd last run
        (16, 256 * 1024, 12_345),
        (64, PAGE, PAGE),  # small runs across many chunks: the kernel
        (64, PAGE, 1),  # a last run of one byte
        (200, 2 * PAGE, 4001),  # more runs than a short plan
    ],
)
def test_scattered_runs(mapping, reg, count, run_bytes, last_bytes) -> None:  # type: ignore[no-untyped-def]
    check_copy(mapping, reg, scattered(count, run_bytes, last_bytes, seed=count + last_bytes))


def test_typed_destination_on_a_side_stream(mapping, reg) -> None:  # type: ignore[no-untyped-def]
    runs = scattered(16, 64 * 1024, 64 * 1024, seed=3)
    stream = torch.cuda.Stream()
    check_copy(mapping, reg, runs, torch.bfloat16, stream)
    check_copy(mapping, reg, runs, torch.float32)


def test_runs_outside_the_segment_queue_nothing(mapping, reg) -> None:  # type: ignore[no-untyped-def]
    out = poisoned(2 * PAGE)
    assert table_cuda.copy_runs_to_cuda(mapping, reg, [(0, PAGE), (SIZE - 10, PAGE)], out) is None
    torch.cuda.synchronize()
    assert bool((out == POISON).all())
    with pytest.raises(ValueError, match="out: holds"):
        table_cuda.copy_runs_to_cuda(mapping, reg, [(0, PAGE)], out)


def test_nothing_is_copied_before_registration(mapping: shm.PoolMapping) -> None:
    rt = _cudart.runtime()
    assert rt is not None
    gate = threading.Event()
    flags = (
        _cudart.HOST_REGISTER_PORTABLE
        | _cudart.HOST_REGISTER_MAPPED
        | _cudart.HOST_REGISTER_READ_ONLY
    )

    def register(ptr: int, nbytes: int) -> None:
        gate.wait(60)
        rt.host_register(ptr, nbytes, flags)

    # A mapping of its own: the module's pool registered these addresses already.
    other = shm.PoolMaps(Path("/dev/shm"))
    desc = pb.HostShmPool(
        segment_name=mapping.name, size=SIZE, page_bytes=PAGE, boot_id=boot_id(),
        st_dev=os.fstat(mapping.fd).st_dev, st_ino=os.fstat(mapping.fd).st_ino,
    )  # fmt: skip
    mine = other.get(pb.PoolHandle(pool_id="q", host_shm=desc))
    assert mine is not None and mine is not mapping
    reg = registered.RegisteredPool(
        mine, register, rt.host_unregister, chunk_bytes=CHUNK, device=torch.cuda.current_device(),
        set_device=rt.set_device,
    )  # fmt: skip
    reg.ensure_started()
    runs = [(2 * CHUNK, 1000), (5 * CHUNK, PAGE)]
    out = poisoned(1000 + PAGE)
    assert not reg.covers(2 * CHUNK, 2 * CHUNK + 1000)
    assert table_cuda.copy_runs_to_cuda(mine, reg, runs, out) is None
    torch.cuda.synchronize()
    assert bool((out == POISON).all())
    gate.set()
    assert reg.wait_registered(120), reg.error
    check_copy(mine, reg, runs)
    reg.close()
    assert table_cuda.copy_runs_to_cuda(mine, reg, runs, out) is None
    with pytest.raises(_cudart.CudaRuntimeError):
        rt.host_device_pointer(mine.tensor.data_ptr())  # unregistered


def test_a_refused_registration_reports_not_usable(mapping: shm.PoolMapping) -> None:
    """Without the read-only flag, CUDA refuses to pin a PROT_READ mapping: the pool says so
    and copies fall back, nothing crashes."""
    rt = _cudart.runtime()
    assert rt is not None
    other = shm.PoolMaps(Path("/dev/shm"))
    st = os.fstat(mapping.fd)
    desc = pb.HostShmPool(
        segment_name=mapping.name, size=SIZE, page_bytes=PAGE, boot_id=boot_id(),
        st_dev=st.st_dev, st_ino=st.st_ino,
    )  # fmt: skip
    mine = other.get(pb.PoolHandle(pool_id="r", host_shm=desc))
    assert mine is not None
    flags = _cudart.HOST_REGISTER_PORTABLE | _cudart.HOST_REGISTER_MAPPED
    reg = registered.RegisteredPool(
        mine, lambda p, n: rt.host_register(p, n, flags), rt.host_unregister, chunk_bytes=CHUNK
    )
    reg.ensure_started()
    if reg.wait_registered(120):
        reg.close()
        pytest.skip("this driver pins a PROT_READ mapping without the read-only flag")
    assert not reg.usable and reg.error
    assert table_cuda.copy_runs_to_cuda(mine, reg, [(0, PAGE)], poisoned(PAGE)) is None
    torch.zeros(1, device="cuda").add_(1)  # the context still works
    torch.cuda.synchronize()
    reg.close()
