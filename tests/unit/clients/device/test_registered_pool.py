"""The host pool's registration chunk by chunk (clients/device/pool_chunks.py, registered.py)
and the CPU side of the copies out of it (table_cuda.py), with fake register functions so
that everything but CUDA itself runs on the CPU."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from embcache.clients.device import registered, shm, table_cuda
from embcache.clients.device.pool_chunks import Piece, PoolChunks
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.proto.locations import boot_id

CHUNK = 4096
SIZE = 5 * CHUNK + 1000  # a short last chunk


class FakeCuda:
    """Records registrations; refuses those ``fail`` names (by chunk index)."""

    def __init__(self, base: int, fail: set[int] | None = None, delay: float = 0.0) -> None:
        self.base = base
        self.fail = fail or set()
        self.delay = delay
        self.gate: threading.Event | None = None
        self.registered: list[tuple[int, int]] = []  # (chunk, bytes), in order
        self.unregistered: list[int] = []
        self.done: set[int] = set()
        self.lock = threading.Lock()

    def register(self, ptr: int, nbytes: int) -> None:
        chunk = (ptr - self.base) // CHUNK
        assert (ptr - self.base) % CHUNK == 0
        if self.gate is not None:
            self.gate.wait(10)
        if self.delay:
            time.sleep(self.delay)
        if chunk in self.fail:
            raise RuntimeError("cudaHostRegister failed: error 801 (operation not supported)")
        with self.lock:
            self.registered.append((chunk, nbytes))
            self.done.add(chunk)

    def unregister(self, ptr: int) -> None:
        with self.lock:
            self.unregistered.append((ptr - self.base) // CHUNK)


class FakeEvent:
    def __init__(self) -> None:
        self.synced = 0

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        self.synced += 1


@pytest.fixture
def mapping(tmp_path: Path) -> Iterator[shm.PoolMapping]:
    path = tmp_path / "seg"
    path.write_bytes(np.arange(SIZE, dtype=np.uint32).astype(np.uint8).tobytes())
    st = path.stat()
    desc = pb.HostShmPool(
        segment_name="seg", size=SIZE, page_bytes=CHUNK, boot_id=boot_id(),
        st_dev=st.st_dev, st_ino=st.st_ino,
    )  # fmt: skip
    m = shm.PoolMaps(tmp_path).get(pb.PoolHandle(pool_id="p", host_shm=desc))
    assert m is not None
    yield m


def make_pool(
    m: shm.PoolMapping, fake: FakeCuda, watch_s: float = registered.WATCH_S
) -> registered.RegisteredPool:
    return registered.RegisteredPool(
        m, fake.register, fake.unregister, chunk_bytes=CHUNK, watch_s=watch_s
    )


def pattern(offset: int, length: int) -> torch.Tensor:
    return torch.arange(offset, offset + length, dtype=torch.int64).remainder(256).to(torch.uint8)


# -- chunk arithmetic -----------------------------------------------------------------------


def test_chunks_cover_the_segment_with_a_short_last_one() -> None:
    c = PoolChunks(SIZE, CHUNK)
    assert c.num_chunks == 6
    assert c.bounds(0) == (0, CHUNK)
    assert c.bounds(5) == (5 * CHUNK, SIZE)
    assert PoolChunks(4 * CHUNK, CHUNK).num_chunks == 4


@pytest.mark.parametrize(
    ("start", "end", "chunks"),
    [
        (0, 0, []),
        (0, 1, [0]),
        (0, CHUNK, [0]),
        (CHUNK - 1, CHUNK + 1, [0, 1]),
        (CHUNK, 2 * CHUNK, [1]),
        (CHUNK, 2 * CHUNK + 1, [1, 2]),
        (0, SIZE, [0, 1, 2, 3, 4, 5]),
        (SIZE - 1, SIZE, [5]),
    ],
)
def test_chunks_of_a_range_at_the_boundaries(start: int, end: int, chunks: list[int]) -> None:
    assert list(PoolChunks(SIZE, CHUNK).chunks_of(start, end)) == chunks


def test_split_cuts_runs_at_chunk_boundaries_in_order() -> None:
    c = PoolChunks(SIZE, CHUNK)
    pieces = c.split([(CHUNK - 10, 20), (0, 0), (3 * CHUNK, 2 * CHUNK + 7), (5, 3)])
    assert pieces == [
        Piece(CHUNK - 10, 10, 0),
        Piece(CHUNK, 10, 1),
        Piece(3 * CHUNK, CHUNK, 3),
        Piece(4 * CHUNK, CHUNK, 4),
        Piece(5 * CHUNK, 7, 5),
        Piece(5, 3, 0),
    ]
    assert c.split([]) == []


@pytest.mark.parametrize("run", [(-1, 4), (0, -1), (SIZE - 3, 4), (SIZE, 1), (2**62, 2**62)])
def test_split_refuses_runs_outside_the_segment(run: tuple[int, int]) -> None:
    assert PoolChunks(SIZE, CHUNK).split([(0, 16), run]) is None


def test_chunk_size_must_keep_chunks_page_aligned() -> None:
    with pytest.raises(ValueError, match="chunk_bytes"):
        PoolChunks(SIZE, 1000)
    with pytest.raises(ValueError, match="size"):
        PoolChunks(0, CHUNK)


# -- registration ---------------------------------------------------------------------------


def test_registers_every_chunk_in_the_background(mapping: shm.PoolMapping) -> None:
    fake = FakeCuda(mapping.tensor.data_ptr())
    reg = make_pool(mapping, fake)
    assert not reg.covers(0, 1)  # nothing registered before start
    assert reg.covers(7, 7)  # an empty range needs nothing
    reg.ensure_started()
    reg.ensure_started()  # idempotent: one thread
    assert reg.wait_registered(10)
    assert sorted(fake.registered) == [(i, CHUNK) for i in range(5)] + [(5, 1000)]
    assert reg.covers(0, SIZE) and reg.covers(SIZE - 1, SIZE)
    assert not reg.covers(0, SIZE + 1) and not reg.covers(-1, 3) and not reg.covers(5, 4)
    stats = reg.stats()
    assert stats["chunks_registered"] == stats["chunks_total"] == 6
    assert stats["bytes_registered"] == SIZE and stats["chunks_failed"] == 0
    assert stats["usable"] == 1
    reg.close()


def test_a_missed_chunk_is_registered_next(mapping: shm.PoolMapping) -> None:
    fake = FakeCuda(mapping.tensor.data_ptr())
    fake.gate = threading.Event()  # holds the thread in its first registration
    reg = make_pool(mapping, fake)
    reg.ensure_started()
    assert not reg.covers(4 * CHUNK, 4 * CHUNK + 1)  # asks for chunk 4
    fake.gate.set()
    assert reg.wait_registered(10)
    assert [c for c, _ in fake.registered][:2] == [0, 4]
    reg.close()


def test_refused_registration_makes_the_pool_unusable(mapping: shm.PoolMapping) -> None:
    fake = FakeCuda(mapping.tensor.data_ptr(), fail={0})
    reg = make_pool(mapping, fake)
    reg.ensure_started()
    assert not reg.wait_registered(10)
    assert not reg.usable
    assert reg.error is not None and "not supported" in reg.error
    assert not reg.covers(0, 1)
    assert fake.registered == []  # stopped at the first refusal
    assert reg.stats()["chunks_failed"] == 1 and reg.stats()["usable"] == 0
    queued: list[int] = []
    assert reg.queue_if_covered([0], lambda: queued.append(1) or FakeEvent()) is None
    assert queued == []
    reg.close()


def test_a_refusal_midway_keeps_the_chunks_already_registered(mapping: shm.PoolMapping) -> None:
    fake = FakeCuda(mapping.tensor.data_ptr(), fail={2})
    reg = make_pool(mapping, fake)
    reg.ensure_started()
    assert not reg.wait_registered(10)
    assert reg.usable
    assert reg.covers(0, 2 * CHUNK) and not reg.covers(0, 2 * CHUNK + 1)
    assert [c for c, _ in fake.registered] == [0, 1]
    reg.close()
    assert sorted(fake.unregistered) == [0, 1]


def test_covers_never_runs_ahead_of_registration(mapping: shm.PoolMapping) -> None:
    fake = FakeCuda(mapping.tensor.data_ptr(), delay=0.002)
    reg = make_pool(mapping, fake)
    bad: list[str] = []
    stop = threading.Event()

    def reader() -> None:
        seen = [False] * 6
        while not stop.is_set():
            for i in range(6):
                lo, hi = PoolChunks(SIZE, CHUNK).bounds(i)
                if reg.covers(lo, hi):
                    if i not in fake.done:
                        bad.append(f"chunk {i} covered before its registration returned")
                    seen[i] = True
                elif seen[i]:
                    bad.append(f"chunk {i} covered, then not")

    readers = [threading.Thread(target=reader) for _ in range(3)]
    for t in readers:
        t.start()
    reg.ensure_started()
    assert reg.wait_registered(20)
    stop.set()
    for t in readers:
        t.join(10)
    assert bad == []
    reg.close()


def test_close_waits_for_queued_copies_then_unregisters_once(mapping: shm.PoolMapping) -> None:
    fake = FakeCuda(mapping.tensor.data_ptr())
    reg = make_pool(mapping, fake)
    reg.ensure_started()
    assert reg.wait_registered(10)
    event = FakeEvent()
    assert reg.queue_if_covered([0, 1], lambda: event) is event
    reg.close()
    assert event.synced == 1
    assert sorted(fake.unregistered) == list(range(6))
    assert reg.closed and not reg.usable and not reg.covers(0, 1)
    assert reg.queue_if_covered([0], FakeEvent) is None
    reg.close()  # idempotent
    assert sorted(fake.unregistered) == list(range(6))
    assert reg.stats()["bytes_registered"] == 0


def test_a_chunk_registered_after_close_is_undone(
    mapping: shm.PoolMapping, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(registered, "_JOIN_S", 0.01)  # close() gives up on the stuck thread
    fake = FakeCuda(mapping.tensor.data_ptr())
    fake.gate = threading.Event()
    reg = make_pool(mapping, fake)
    reg.ensure_started()
    time.sleep(0.05)  # the thread waits inside its first registration
    reg.close()
    assert reg.closed and fake.unregistered == []
    fake.gate.set()
    deadline = time.monotonic() + 10
    while not fake.unregistered and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fake.unregistered == [0] and [c for c, _ in fake.registered] == [0]
    assert not reg.covers(0, 1) and reg.stats()["chunks_registered"] == 0


def test_a_removed_segment_retires_the_registration(
    mapping: shm.PoolMapping, tmp_path: Path
) -> None:
    fake = FakeCuda(mapping.tensor.data_ptr())
    reg = make_pool(mapping, fake, watch_s=0.01)
    reg.ensure_started()
    assert reg.wait_registered(10)
    event = FakeEvent()
    reg.queue_if_covered([3], lambda: event)
    (tmp_path / "seg").unlink()  # the daemon closed: its segment is gone
    deadline = time.monotonic() + 10
    while not reg.closed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert reg.closed and not reg.covers(0, 1)
    assert event.synced == 1
    assert sorted(fake.unregistered) == list(range(6))
    assert mapping.tensor[:4].tolist() == [0, 1, 2, 3]  # still mapped: nothing else changed


def test_a_removed_segment_is_not_registered(mapping: shm.PoolMapping, tmp_path: Path) -> None:
    (tmp_path / "seg").unlink()
    fake = FakeCuda(mapping.tensor.data_ptr())
    reg = make_pool(mapping, fake)
    reg.ensure_started()
    reg.wait_registered(10)
    assert fake.registered == [] and reg.closed


def test_without_cuda_there_is_no_registration(mapping: shm.PoolMapping) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert registered.registered_pool(mapping) is None


def test_the_process_exits_while_registration_runs(tmp_path: Path) -> None:
    code = f"""
        import mmap, os, time, torch
        from embcache.clients.device import registered, shm
        path = {str(tmp_path / "big")!r}
        with open(path, "wb") as f:
            f.truncate(4096 * 1000)
        fd = os.open(path, os.O_RDONLY)
        mm = mmap.mmap(fd, 4096 * 1000, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        import warnings
        warnings.simplefilter("ignore")
        m = shm.PoolMapping("big", 4096 * 1000, torch.frombuffer(mm, dtype=torch.uint8), mm, fd)
        reg = registered.RegisteredPool(
            m, lambda p, n: time.sleep(0.05), lambda p: None, chunk_bytes=4096
        )
        reg.ensure_started()
        time.sleep(0.1)
        print("exiting", reg.stats()["chunks_registered"] < 1000)
    """
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "exiting True"


# -- copies ---------------------------------------------------------------------------------


def test_copy_runs_to_host_copies_in_order(mapping: shm.PoolMapping) -> None:
    runs = [(3 * CHUNK, 100), (5, 17), (CHUNK - 3, 9)]
    out = table_cuda.copy_runs_to_host(mapping, runs)
    assert out is not None
    assert torch.equal(out, torch.cat([pattern(o, n) for o, n in runs]))
    given = torch.full((126,), 0xAB, dtype=torch.uint8)
    assert table_cuda.copy_runs_to_host(mapping, runs, given) is given
    assert torch.equal(given, out)
    wide = torch.zeros(2, dtype=torch.int64)  # any dtype of the right size
    assert table_cuda.copy_runs_to_host(mapping, [(8, 16)], wide) is wide
    assert torch.equal(wide.view(torch.uint8), pattern(8, 16))


def test_copy_runs_to_host_refuses_bad_input(mapping: shm.PoolMapping) -> None:
    poisoned = torch.full((10,), 0xAB, dtype=torch.uint8)
    assert table_cuda.copy_runs_to_host(mapping, [(0, 4), (SIZE - 5, 6)], poisoned[:10]) is None
    assert table_cuda.copy_runs_to_host(mapping, [(-2, 10)], poisoned) is None
    assert bool((poisoned == 0xAB).all())  # nothing written
    with pytest.raises(ValueError, match="out: holds 10 bytes"):
        table_cuda.copy_runs_to_host(mapping, [(0, 11)], poisoned)
    with pytest.raises(ValueError, match="contiguous"):
        table_cuda.copy_runs_to_host(mapping, [(0, 5)], poisoned[::2])


def test_copy_runs_to_cuda_refuses_a_cpu_destination(mapping: shm.PoolMapping) -> None:
    reg = make_pool(mapping, FakeCuda(mapping.tensor.data_ptr()))
    with pytest.raises(ValueError, match="out: must be a CUDA tensor"):
        table_cuda.copy_runs_to_cuda(mapping, reg, [(0, 4)], torch.zeros(4, dtype=torch.uint8))


@pytest.mark.parametrize(
    "runs",
    [
        [(0, 2 * CHUNK), (3 * CHUNK, CHUNK)],  # whole chunks
        [(CHUNK, 3 * CHUNK + 1000 - 1000), (0, 333)],  # across chunks, odd last run
        [(2 * CHUNK - 64, 128), (4 * CHUNK, 7)],  # last run shorter than a row
        [(16 * k, 16) for k in range(0, 40, 3)] + [(5 * CHUNK, 1000)],
        [(5, 3), (100, 17), (CHUNK - 1, 2)],  # odd offsets: one-byte rows
    ],
)
def test_piece_plans_copy_what_the_runs_name(
    mapping: shm.PoolMapping, runs: list[tuple[int, int]]
) -> None:
    chunks = PoolChunks(SIZE, CHUNK)
    pieces = chunks.split(runs)
    assert pieces is not None and len(pieces) >= 2
    plan = table_cuda.plan_pieces(chunks, pieces)
    assert plan.base % CHUNK == 0 and plan.top <= SIZE
    assert int((plan.lengths > 0).sum()) == len(plan.lengths)
    total = sum(n for _, n in runs)
    out = torch.full((total,), 0xAB, dtype=torch.uint8)
    table_cuda.run_piece_plan(plan, mapping.tensor, out, None)
    assert torch.equal(out, torch.cat([pattern(o, n) for o, n in runs]))


def test_row_bytes_for_is_the_widest_dividing_power_of_two() -> None:
    assert table_cuda.row_bytes_for(4096, 8192, 0) == 16
    assert table_cuda.row_bytes_for(4096, 24) == 8
    assert table_cuda.row_bytes_for(4096, 7) == 1
    assert table_cuda.row_bytes_for() == 16
