"""Device RPCs over a real gRPC server on a CPU machine.

The engine has a CPU "device" pool (``ipc_mode`` 'none', uuid ``CPU-0``): Get with that uuid
returns real device locations (pages or offset) and the client turns them into tensors.
CUDA IPC itself cannot run here, so two things are faked, and only these: the daemon's IPC
backend (client "allocations" are CPU buffers registered under random 64-byte handles) and
the client's pool opener (it hands back the engine's pool memory). Everything else (request
validation, the mapping cache, the worker threads, leases, offsets, the wire) is real. The
CUDA paths are tested in tests/gpu/test_grpc_device.py.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch

from embcache.clients import AsyncEmbCacheClient, EmbCacheClient
from embcache.clients._backends.async_session import AsyncSession
from embcache.clients._backends.async_socket_session import AsyncSocketSession
from embcache.clients._backends.sync_session import Session
from embcache.clients._backends.sync_socket_session import SocketSession
from embcache.clients.device import device_replies as dr
from embcache.clients.device import exports, into, table_reads
from embcache.clients.device import pools as client_device
from embcache.clients.device import puts as device_puts
from embcache.errors import DeviceUnavailable, InvalidArgument
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.proto.embcache.v1 import services as pb_grpc
from embcache.service.config import Settings
from embcache.service.device.ipc.cache import IpcCache
from embcache.service.device.pool import DevicePool
from embcache.service.engine import CacheEngine
from embcache.service.transport.handlers import device_puts as grpc_device_puts
from embcache.service.transport.serving import DataPlane, GrpcServerThread

KiB, MiB = 1 << 10, 1 << 20
PAGE = 64 * KiB
FAKE_GPU = "GPU-fake-0"
C = grpc.StatusCode


class FakeMapping:
    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf
        self.nbytes = buf.numel()
        self.closed = False

    def tensor(self, offset: int = 0, nbytes: int | None = None) -> torch.Tensor:
        n = self.nbytes - offset if nbytes is None else nbytes
        return self.buf[offset : offset + n]

    def close(self) -> None:
        self.closed = True


class FakeEvent:
    def __init__(self, waits: list[bytes], handle: bytes, fired: Callable[[], bool]) -> None:
        self.waits, self.handle, self._fired = waits, handle, fired

    def synchronize(self) -> None:  # blocks until fired, as a CUDA event does (5 s at most)
        self.waits.append(self.handle)
        give_up = time.monotonic() + 5
        while not self._fired() and time.monotonic() < give_up:
            time.sleep(0.001)

    def query(self) -> bool:  # the daemon polls first: fired at once unless told otherwise
        self.waits.append(self.handle)
        return self._fired()


class FakeRecorded:
    def __init__(self, handle: bytes, free: list[FakeRecorded]) -> None:
        self.handle, self.free = handle, free

    def done(self) -> None:
        self.free.append(self)


class FakeIpc:
    """Client allocations are CPU buffers registered under random 64-byte handles."""

    def __init__(self) -> None:
        self.buffers: dict[bytes, torch.Tensor] = {}
        self.opened: list[FakeMapping] = []
        self.events: list[bytes] = []  # every wait, in order
        self.event_opens: list[bytes] = []
        self.free_events: list[FakeRecorded] = []  # client side, for fake_cuda_puts
        self.made_events: set[bytes] = set()
        self.unfired: set[bytes] = set()  # client events whose work has not finished yet

    def register(self, buf: torch.Tensor) -> bytes:
        handle = os.urandom(64)
        self.buffers[handle] = buf
        return handle

    def available(self) -> bool:
        return True

    def gpu_index(self, gpu_uuid: str) -> int | None:
        return 0 if gpu_uuid == FAKE_GPU else None

    def open(self, handle: bytes, device: int, alloc_size: int) -> FakeMapping:
        buf = self.buffers.get(handle)
        if buf is None:
            raise DeviceUnavailable("unknown handle")
        if alloc_size > buf.numel():
            raise InvalidArgument("alloc_size is larger than the allocation")
        mapping = FakeMapping(buf)
        self.opened.append(mapping)
        return mapping

    def open_event(self, handle: bytes, device: int) -> FakeEvent:
        self.event_opens.append(handle)
        return FakeEvent(self.events, handle, lambda: handle not in self.unfired)


class FakePools:
    """Client-side pool opener that hands back the engine's (CPU) pool memory."""

    def __init__(self, pool: DevicePool) -> None:
        self.pool = pool
        self.opens = 0
        self._open: dict[str, torch.Tensor] = {}

    def pool_tensor(self, handle: client_device.DevicePoolHandle, size: int) -> torch.Tensor:
        assert handle.pool_id == self.pool.pool_id and handle.ipc_handle is None
        if handle.pool_id not in self._open:
            self.opens += 1
            self._open[handle.pool_id] = self.pool.tensor[:size]
        return self._open[handle.pool_id]


Server = tuple[CacheEngine, DataPlane, FakeIpc]


@pytest.fixture
def dev_server(shm_name: str) -> Iterator[Server]:
    with tempfile.TemporaryDirectory(prefix="ecd-") as d:
        settings = Settings(
            grpc_port=0,
            grpc_socket=Path(d) / "d.sock",
            shm_name=shm_name,
            host_pool_bytes=4 * MiB,
            page_bytes=PAGE,
            device="cpu",
        )
        pool = DevicePool(torch.device("cpu"), 16 * PAGE, PAGE)
        engine = CacheEngine(settings, device_pools=[pool])
        thread = GrpcServerThread(engine, settings)
        try:
            service = thread.start()
            fake = FakeIpc()
            ipc = service.servicer.device.ipc
            assert isinstance(ipc, IpcCache) and not len(ipc)
            assert not ipc.backend.available()  # CPU mode: the real backend refuses
            # Faked in place: the sessions' handlers hold this cache (drop_ipc at their end).
            ipc.backend, ipc.max_mappings = fake, 4
            yield engine, service, fake
        finally:
            thread.stop()
            engine.close()


@pytest.fixture
def stub(dev_server: Server) -> Iterator[pb_grpc.EmbeddingCacheStub]:
    with grpc.insecure_channel(f"unix:{dev_server[1].socket_path}") as channel:
        yield pb_grpc.EmbeddingCacheStub(channel)


def blob(nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not predicate():
        time.sleep(0.01)
    return predicate()


def device_gets_are_calls(monkeypatch) -> list[list[str]]:  # type: ignore[no-untyped-def]
    """The faked "cuda" device is the CPU, which the read table's copies to a GPU cannot
    target: they find nothing here, so every device get is a call to the daemon (those
    copies run in tests/gpu/). Returns the keys the table was asked for, get by get."""
    asked: list[list[str]] = []
    monkeypatch.setattr(table_reads, "to_cuda", lambda table, keys, device: asked.append(keys))
    return asked


def fragment_device_pool(engine: CacheEngine) -> dict[str, torch.Tensor]:
    """Fill the 16-page pool with 2-page entries, then make the LRU evict every other one,
    so that a 3-page entry lands in two runs."""
    data = {f"f{i}": blob(2 * PAGE, i) for i in range(8)}
    data["big"] = blob(3 * PAGE - 100, 99)
    for key, t in data.items():
        engine.put(key, t)
    first, _ = engine.device.get([f"f{i}" for i in range(8)], "setup")
    again, _ = engine.device.get([f"f{i}" for i in (1, 3, 5, 7)], "setup")
    engine.drop_owner("setup")
    assert all(d is not None for d in first + again)
    return data


# -- Get with a GPU uuid ---------------------------------------------------------------------
def test_device_locations_over_the_wire(dev_server: Server, stub) -> None:
    engine, _, _ = dev_server
    data = fragment_device_pool(engine)
    reply = stub.Get(pb.GetRequest(keys=["big", "f1", "nope"], gpu_uuid="CPU-0"))
    big, f1, miss = reply.results
    assert not miss.found and big.found and f1.found
    assert big.device.WhichOneof("placement") == "pages" and len(big.device.pages.page_ids) == 3
    assert f1.device.WhichOneof("placement") == "offset" and f1.device.gpu_uuid == "CPU-0"
    (pool,) = reply.pools
    pool_desc = engine.device_tier.pool(0)
    assert pool.pool_id == big.device.pool_id == pool_desc.pool_id
    assert pool.device.size == pool_desc.nbytes and pool.device.page_bytes == PAGE
    assert pool.device.WhichOneof("handle") is None  # a CPU test pool exports nothing
    assert engine.stats().leases_active == 2
    decoded = dr.decode_device_get(reply, FakePools(pool_desc))  # type: ignore[arg-type]
    a, b, c = decoded.tensors
    assert c is None and a is not None and b is not None
    assert torch.equal(a.view(-1), data["big"]) and torch.equal(b.view(-1), data["f1"])
    assert stub.Release(pb.ReleaseRequest(lease_ids=decoded.lease_ids)).released == 2
    # Asking for a ready event: a pool without a stream has copied by reply time, so none.
    again = stub.Get(pb.GetRequest(keys=["big"], gpu_uuid="CPU-0", ready_event=True))
    assert again.results[0].found and not again.HasField("event_handle")
    stub.Release(pb.ReleaseRequest(lease_ids=[again.results[0].lease_id]))


def test_client_reports_an_event_it_cannot_open(dev_server: Server, stub) -> None:
    engine, _, _ = dev_server
    engine.put("k", blob(PAGE, 3))
    reply = stub.Get(pb.GetRequest(keys=["k"], gpu_uuid="CPU-0"))
    reply.event_handle = bytes(64)  # as a GPU daemon would send while its copy runs

    class NoEvents(FakePools):
        def ready_event(self, handle: bytes, device: torch.device) -> None:
            raise RuntimeError("CUDA error: invalid resource handle")

    with pytest.raises(dr.EventOpenError, match="invalid resource handle"):
        dr.decode_device_get(reply, NoEvents(engine.device_tier.pool(0)))  # type: ignore[arg-type]
    stub.Release(pb.ReleaseRequest(lease_ids=[reply.results[0].lease_id]))


def test_device_get_errors(dev_server: Server, stub) -> None:
    engine, _, _ = dev_server
    engine.put("k", blob(100, 1))
    with pytest.raises(grpc.RpcError) as err:
        stub.Get(pb.GetRequest(keys=["k"], gpu_uuid="GPU-not-here"))
    assert err.value.code() == C.FAILED_PRECONDITION
    assert "CPU-0" in (err.value.details() or "")  # names the pools it has
    engine.put("huge", blob(17 * PAGE, 2))  # larger than the device pool
    with pytest.raises(grpc.RpcError) as err:
        stub.Get(pb.GetRequest(keys=["k", "huge"], gpu_uuid="CPU-0"))
    assert err.value.code() == C.RESOURCE_EXHAUSTED
    assert engine.stats().leases_active == 0


def test_client_get_to_device(dev_server: Server, monkeypatch) -> None:
    engine, service, _ = dev_server
    data = fragment_device_pool(engine)
    synced: list[torch.device] = []
    monkeypatch.setattr(client_device, "resolve_device", lambda d: (torch.device("cpu"), "CPU-0"))
    monkeypatch.setattr(dr, "sync_device", synced.append)
    asked = device_gets_are_calls(monkeypatch)
    pools = FakePools(engine.device_tier.pool(0))
    base = engine.device_tier.pool(0).tensor.data_ptr()

    def in_pool(t: torch.Tensor) -> bool:
        return base <= t.data_ptr() < base + 16 * PAGE

    with EmbCacheClient(f"unix:{service.socket_path}", timeout=10) as client:
        client._state.device_pools = pools  # type: ignore[assignment]
        with client.get(["big", "f1", "nope"], device="cuda") as (a, b, c):
            assert c is None and torch.equal(a.view(-1), data["big"])
            assert torch.equal(b.view(-1), data["f1"])
            assert not in_pool(a) and not in_pool(b)  # copies the caller owns, by default
            b.mul_(2)  # ... so a write never reaches the pool
            assert engine.stats().leases_active == 2
        assert engine.stats().leases_active == 0 and len(synced) == 1  # copies: at once
        with client.get(["f1"], device="cuda") as (again,):
            assert torch.equal(again.view(-1), data["f1"])  # the entry did not change
        # zero_copy: contiguous entries are views of the pool, whose leases end once the
        # views are gone; fragmented ones are gathered copies either way.
        with client.get(["big", "f1"], device="cuda", zero_copy=True) as (a, b):
            assert not in_pool(a) and in_pool(b) and torch.equal(b.view(-1), data["f1"])
        assert engine.stats().leases_active == 1  # b is alive: so is its lease
        assert torch.equal(b.view(-1), data["f1"])
        del a, b, again
        assert wait_for(lambda: engine.stats().leases_active == 0)
        assert pools.opens == 1
    assert asked == [["big", "f1", "nope"], ["f1"]]  # copies look there first; views never


def test_client_falls_back_without_a_device_pool(dev_server: Server, monkeypatch) -> None:
    engine, service, _ = dev_server
    engine.put("k", blob(1000, 3))
    monkeypatch.setattr(client_device, "resolve_device", lambda d: (torch.device("cpu"), "GPU-x"))
    device_gets_are_calls(monkeypatch)
    calls: list[str] = []
    with EmbCacheClient(f"unix:{service.socket_path}", timeout=10) as client:
        placed = client._host_gets.placed
        monkeypatch.setattr(
            client._host_gets, "placed", lambda ls, d: calls.append(str(d)) or placed(ls, None)
        )
        with client.get(["k"], device="cuda") as (t,):
            assert torch.equal(t, blob(1000, 3))
        assert set(client._state.no_device) == {"GPU-x"} and calls == ["cuda"]


def test_evict_one_gpus_copies(dev_server: Server, stub, monkeypatch) -> None:
    # Evict with gpu_uuid drops that GPU's copies only: the entry and its host copy stay.
    engine, service, _ = dev_server
    for key, seed in (("a", 1), ("b", 2)):
        engine.put(key, blob(PAGE, seed))
    gpu = engine.device_tier.pool(0).gpu_uuid
    reply = stub.Get(pb.GetRequest(keys=["a", "b"], gpu_uuid=gpu))
    stub.Release(pb.ReleaseRequest(lease_ids=[reply.results[0].lease_id]))
    out = stub.Evict(pb.EvictRequest(keys=["a", "b", "zz"], gpu_uuid=gpu))
    assert [r.outcome for r in out.results] == [pb.EVICTED, pb.LEASED, pb.NOT_FOUND]
    assert engine.entry_info("a").residency == ("host",)  # type: ignore[union-attr]
    assert list(stub.Exists(pb.ExistsRequest(keys=["a"])).exists) == [True]
    with pytest.raises(grpc.RpcError) as err:  # one key fails loudly: no copy there now
        stub.Evict(pb.EvictRequest(keys=["a"], gpu_uuid=gpu))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:
        stub.Evict(pb.EvictRequest(keys=["a"], gpu_uuid="GPU-none"))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    monkeypatch.setattr(client_device, "resolve_device", lambda d: (torch.device("cpu"), gpu))
    stub.Release(pb.ReleaseRequest(lease_ids=[reply.results[1].lease_id]))
    with EmbCacheClient(f"unix:{service.socket_path}", timeout=10) as client:
        assert client.evict(["b", "a"], device="cuda") == ["evicted", "not_found"]
        assert client.exists(["a", "b"]) == [True, True]


# -- PutFromDevice ---------------------------------------------------------------------------
def ipc_tensor(handle: bytes, t: torch.Tensor, offset: int, alloc: int, **kw) -> pb.CudaIpcTensor:
    return pb.CudaIpcTensor(
        gpu_uuid=FAKE_GPU,
        ipc_handle=handle,
        offset=offset,
        alloc_size=alloc,
        dtype=str(t.dtype).removeprefix("torch."),
        shape=list(t.shape),
        **kw,
    )


def test_put_from_device_and_mapping_cache(dev_server: Server, stub) -> None:
    engine, _, fake = dev_server
    src = (torch.randn(100, 33) * 3).to(torch.bfloat16)
    raw = src.view(-1).view(torch.uint8)
    buf = torch.full((64 * KiB,), 0xEE, dtype=torch.uint8)
    buf[256 : 256 + raw.numel()] = raw
    handle = fake.register(buf)
    crc = zlib.crc32(raw.numpy().tobytes())
    tensor = ipc_tensor(handle, src, 256, buf.numel(), event_handle=b"e" * 64, strides=[33, 1])
    reply = stub.PutFromDevice(pb.PutFromDeviceRequest(key="pd", tensor=tensor, checksum=crc))
    assert reply.created and reply.nbytes == raw.numel()
    again = stub.PutFromDevice(pb.PutFromDeviceRequest(key="pd2", tensor=tensor))
    assert again.created and len(fake.opened) == 1 and fake.events == [b"e" * 64] * 2
    assert fake.event_opens == [b"e" * 64] * 2  # no session: the event is opened each time
    for key in ("pd", "pd2"):
        (lease,) = engine.get([key], "t")
        assert lease is not None and torch.equal(engine.tensor(lease), src)
    engine.drop_owner("t")
    with pytest.raises(grpc.RpcError) as err:  # wrong checksum: nothing stored
        stub.PutFromDevice(pb.PutFromDeviceRequest(key="pd3", tensor=tensor, checksum=crc ^ 1))
    assert err.value.code() == C.INVALID_ARGUMENT and engine.exists(["pd3"]) == [False]
    empty = pb.CudaIpcTensor(gpu_uuid=FAKE_GPU, ipc_handle=b"\1" * 64, dtype="float16", shape=[0])
    assert stub.PutFromDevice(pb.PutFromDeviceRequest(key="e", tensor=empty)).created
    assert len(fake.opened) == 1  # an empty tensor is not mapped


def test_mappings_are_bounded_and_end_with_the_session(dev_server: Server, stub) -> None:
    _, service, fake = dev_server
    cache = service.servicer.device.ipc
    src = torch.arange(64, dtype=torch.float32)
    handles = [fake.register(src.view(torch.uint8).clone()) for _ in range(6)]
    for i, h in enumerate(handles):  # anonymous caller: only the LRU bound (4) closes
        stub.PutFromDevice(pb.PutFromDeviceRequest(key=f"a{i}", tensor=ipc_tensor(h, src, 0, 256)))
    assert len(cache) == 4 and [m.closed for m in fake.opened] == [True] * 2 + [False] * 4
    done = threading.Event()

    def requests():
        yield pb.SessionRequest(hello=pb.SessionHello(client_name="enc", pid=1))
        done.wait(10)

    call = stub.Session(requests())
    md = (("x-embcache-session", next(call).opened.session_id),)
    h = fake.register(src.view(torch.uint8).clone())
    tensor = ipc_tensor(h, src, 0, 256)
    stub.PutFromDevice(pb.PutFromDeviceRequest(key="s", tensor=tensor), metadata=md)
    session_mapping = fake.opened[-1]
    call.cancel()
    done.set()
    assert wait_for(lambda: session_mapping.closed)
    assert not fake.opened[-2].closed  # anonymous mappings stay until the LRU drops them


BAD_PUTS: dict[str, tuple[Callable[[pb.CudaIpcTensor], None], grpc.StatusCode]] = {
    "short handle": (lambda t: setattr(t, "ipc_handle", b"x" * 10), C.INVALID_ARGUMENT),
    "posix fd": (lambda t: t.posix_fd.CopyFrom(pb.PosixFdHandle(fd_token=1)), C.INVALID_ARGUMENT),
    "strided": (lambda t: t.strides.extend([1, 100]), C.INVALID_ARGUMENT),
    "past alloc": (lambda t: setattr(t, "offset", 60 * KiB), C.INVALID_ARGUMENT),
    "lying alloc": (lambda t: setattr(t, "alloc_size", 1 << 30), C.INVALID_ARGUMENT),
    "other gpu": (lambda t: setattr(t, "gpu_uuid", "GPU-other"), C.FAILED_PRECONDITION),
    "bad dtype": (lambda t: setattr(t, "dtype", "complex64"), C.INVALID_ARGUMENT),
    "short event": (lambda t: setattr(t, "event_handle", b"e"), C.INVALID_ARGUMENT),
    "negative dim": (lambda t: t.shape.__setitem__(0, -1), C.INVALID_ARGUMENT),
    "unknown handle": (lambda t: setattr(t, "ipc_handle", b"u" * 64), C.FAILED_PRECONDITION),
}


def session_call(stub, **request) -> pb.SessionResult:  # type: ignore[no-untyped-def]
    """One call on a Session stream of its own (raw wire), and its result. The stream stays
    open until the result is read (ending it would cancel the call)."""
    read = threading.Event()

    def requests() -> Iterator[pb.SessionRequest]:
        yield pb.SessionRequest(call=pb.SessionCall(call_id=1, **request))
        read.wait(10)

    replies = stub.Session(requests())
    assert next(replies).opened.device_puts
    result: pb.SessionResult = next(replies).result
    read.set()
    replies.cancel()
    return result


@pytest.mark.parametrize("name", sorted(BAD_PUTS))
@pytest.mark.parametrize("on_session", [False, True])
def test_put_from_device_validation(dev_server: Server, stub, name: str, on_session) -> None:
    engine, _, fake = dev_server
    src = torch.zeros(100, 33, dtype=torch.bfloat16)
    tensor = ipc_tensor(fake.register(torch.zeros(64 * KiB, dtype=torch.uint8)), src, 0, 64 * KiB)
    mutate, code = BAD_PUTS[name]
    mutate(tensor)
    request = pb.PutFromDeviceRequest(key="bad", tensor=tensor)
    if on_session:  # the same error table on the Session stream
        assert session_call(stub, put_from_device=request).error.code == code.name
    else:
        with pytest.raises(grpc.RpcError) as err:
            stub.PutFromDevice(request)
        assert err.value.code() == code, err.value.details()
    assert not fake.opened and fake.events == []  # refused before anything was mapped
    s = engine.stats()
    assert s.entries_ready == 0 and s.entries_filling == 0


# -- PutFromDeviceBatch ----------------------------------------------------------------------
def batch_items(fake: FakeIpc, n: int = 3) -> tuple[list[pb.PutFromDeviceRequest], list]:
    """``n`` tensors in two client allocations (the first two share one), with checksums."""
    srcs = [blob(3 * KiB + 17 * i, i).view(-1) for i in range(n)]
    shared = torch.full((64 * KiB,), 0xEE, dtype=torch.uint8)
    own = torch.full((64 * KiB,), 0xDD, dtype=torch.uint8)
    h_shared, h_own = fake.register(shared), fake.register(own)
    items, at = [], 0
    for i, src in enumerate(srcs):
        buf, handle, off = (shared, h_shared, at) if i < 2 else (own, h_own, 128)
        buf[off : off + src.numel()] = src
        at += 4 * KiB
        crc = zlib.crc32(src.numpy().tobytes())
        tensor = ipc_tensor(handle, src, off, buf.numel(), event_handle=bytes([i]) * 64)
        items.append(pb.PutFromDeviceRequest(key=f"b{i}", tensor=tensor, checksum=crc))
    return items, srcs


@pytest.mark.parametrize("inline", [True, False])
def test_put_from_device_batch(dev_server: Server, stub, monkeypatch, inline: bool) -> None:
    """On the loop, or in a worker thread (batches of more than INLINE_ITEMS items)."""
    if not inline:
        monkeypatch.setattr(grpc_device_puts, "INLINE_ITEMS", 2)
    engine, _, fake = dev_server
    items, srcs = batch_items(fake)
    empty = pb.CudaIpcTensor(gpu_uuid=FAKE_GPU, ipc_handle=b"\1" * 64, dtype="float16", shape=[0])
    items.append(pb.PutFromDeviceRequest(key="b-empty", tensor=empty))
    reply = stub.PutFromDeviceBatch(pb.PutFromDeviceBatchRequest(items=items))
    assert [r.created for r in reply.results] == [True] * 4
    assert [r.nbytes for r in reply.results] == [t.numel() for t in srcs] + [0]
    assert len(fake.opened) == 2  # one mapping per client allocation, the empty one none
    assert sorted(fake.events) == sorted(bytes([i]) * 64 for i in range(3))
    leases = engine.get([f"b{i}" for i in range(3)], "t")
    for lease, src in zip(leases, srcs, strict=True):
        assert lease is not None and torch.equal(engine.tensor(lease), src)
    engine.drop_owner("t")
    again = stub.PutFromDeviceBatch(pb.PutFromDeviceBatchRequest(items=items[:2]))
    assert [r.created for r in again.results] == [False, False]  # idempotent
    assert stub.PutFromDeviceBatch(pb.PutFromDeviceBatchRequest()).results == []


NOPE = b"u" * 64  # a handle the fake IPC backend never registered


def nothing_left(engine: CacheEngine, keys: list[str]) -> None:
    s = engine.stats()
    assert engine.exists(keys) == [False] * len(keys)
    assert s.entries_filling == 0 and s.reserved_filling_bytes == 0


def test_put_from_device_batch_is_all_or_nothing(dev_server: Server, stub) -> None:
    engine, _, fake = dev_server
    items, _ = batch_items(fake)
    free = engine.stats().host.free_pages
    items[2].checksum ^= 1  # the last item's bytes do not match: none of the batch stays
    with pytest.raises(grpc.RpcError) as err:
        stub.PutFromDeviceBatch(pb.PutFromDeviceBatchRequest(items=items))
    assert err.value.code() == C.INVALID_ARGUMENT and "checksum" in err.value.details()
    nothing_left(engine, ["b0", "b1", "b2"])
    assert engine.stats().host.free_pages == free


BAD_BATCHES = {
    "bad tensor": (lambda it: setattr(it[1].tensor, "offset", 63 * KiB), C.INVALID_ARGUMENT),
    "bad key": (lambda it: setattr(it[2], "key", ""), C.INVALID_ARGUMENT),
    "same key twice": (lambda it: setattr(it[2], "key", "b0"), C.INVALID_ARGUMENT),
    "other gpu": (lambda it: setattr(it[1].tensor, "gpu_uuid", "GPU-9"), C.FAILED_PRECONDITION),
    "unknown handle": (lambda it: setattr(it[2].tensor, "ipc_handle", NOPE), C.FAILED_PRECONDITION),
    "too many": (lambda it: it.extend([it[0]] * 1024), C.INVALID_ARGUMENT),
}


@pytest.mark.parametrize("name", sorted(BAD_BATCHES))
def test_put_from_device_batch_refusals(dev_server: Server, stub, name: str) -> None:
    engine, _, fake = dev_server
    items, _ = batch_items(fake)
    mutate, code = BAD_BATCHES[name]
    mutate(items)
    with pytest.raises(grpc.RpcError) as err:
        stub.PutFromDeviceBatch(pb.PutFromDeviceBatchRequest(items=items))
    assert err.value.code() == code, (name, err.value.details())
    nothing_left(engine, ["b0", "b1", "b2"])
    if name != "unknown handle":  # refused before anything was mapped
        assert not fake.opened and fake.events == []


def fake_cuda_puts(monkeypatch, fake: FakeIpc, marked: set[int]) -> None:  # type: ignore[no-untyped-def]
    """Clients treat the tensors in ``marked`` (by id) as CUDA tensors, exported through the
    fake IPC backend (their own bytes are the "allocation")."""

    def export(t: torch.Tensor, *, as_bytes: bool = False, event: bool = True) -> exports.Exported:
        raw = t.reshape(-1).view(torch.uint8)
        out = exports.Exported(ipc_tensor(fake.register(raw), t, 0, raw.numel()), t)
        if event:
            record(t.device, [out])
        return out

    def record(device: torch.device, exported: list[exports.Exported]) -> None:
        """One event per call, reused once a call returned (as ``IpcEvents`` does)."""
        free = fake.free_events
        rec = free.pop() if free else FakeRecorded(b"%02d" % len(fake.made_events) * 32, free)
        fake.made_events.add(rec.handle)
        for e in exported:
            e.message.event_handle = rec.handle
        exported[0].events.append(rec)  # type: ignore[arg-type]

    wants = lambda t: id(t) in marked  # noqa: E731
    monkeypatch.setattr(device_puts, "wants_device_put", wants)
    monkeypatch.setattr(exports, "export_cuda", export)
    monkeypatch.setattr(exports, "record_event", record)
    monkeypatch.setattr(device_puts, "MAX_ITEMS", 2)  # three device tensors: two calls


@pytest.mark.parametrize("use_async", [False, True])
def test_client_put_many(dev_server: Server, monkeypatch, use_async: bool) -> None:
    engine, service, fake = dev_server
    tensors = {"d0": blob(5000, 1), "h": torch.randn(7, 3), "d1": blob(300, 2), "d2": blob(9, 3)}
    fake_cuda_puts(monkeypatch, fake, {id(tensors[k]) for k in ("d0", "d1", "d2")})
    batches: list[int] = []
    real = grpc_device_puts.put_from_device_batch

    async def counting(puts, request, owner, quota):  # type: ignore[no-untyped-def]
        batches.append(len(request.items))
        return await real(puts, request, owner, quota)

    # The daemon's device puts, whether a session call or an RPC asks for them.
    monkeypatch.setattr(grpc_device_puts, "put_from_device_batch", counting)
    target = f"unix:{service.socket_path}"
    kinds = session_calls(monkeypatch)

    def put_twice() -> tuple[list[bool], list[bool]]:
        if not use_async:
            with EmbCacheClient(target, timeout=10) as client:
                return client.put_many(tensors), client.put_many(list(tensors.items()))

        async def main() -> tuple[list[bool], list[bool]]:
            async with AsyncEmbCacheClient(target, timeout=10) as client:
                return await client.put_many(tensors), await client.put_many(tensors)

        return asyncio.run(main())

    first, again = put_twice()
    assert first == [True] * 4 and again == [False] * 4
    assert batches == [2, 1, 2, 1]
    # On the session stream, not as RPCs: the host tensor went into this process's stash
    # (the second time it was listed in the read table already: no call), and the stash was
    # given back at close.
    device = ["put_from_device_batch", "put_from_device_batch"]
    # The host tensor's first commit was posted (no call); the second put commits with a
    # call unless the read table listed it by then.
    assert [k for k in kinds if k != "stash_commit"] == [
        *device,
        "stash_refill",
        *device,
        "put_abort",
    ]
    assert kinds.count("stash_commit") <= 1
    # one event per batch, waited on once per call; both given back and reused next time
    assert len(fake.events) == 4 and len(fake.made_events) == 2
    assert len(fake.event_opens) == 2  # the daemon opened each once (one session)
    for key, src in tensors.items():
        (lease,) = engine.get([key], "t")
        assert lease is not None and torch.equal(engine.tensor(lease), src)
    engine.drop_owner("t")


def session_calls(monkeypatch) -> list[str]:  # type: ignore[no-untyped-def]
    """The kinds of the session calls the clients (sync and async) send from now on."""
    kinds: list[str] = []

    def counted(cls):  # type: ignore[no-untyped-def]
        real = cls.call

        def call(self, timeout, **request):  # type: ignore[no-untyped-def]
            kinds.extend(request)
            return real(self, timeout, **request)

        monkeypatch.setattr(cls, "call", call)

    def acounted(cls):  # type: ignore[no-untyped-def]
        real = cls.call

        async def acall(self, timeout, **request):  # type: ignore[no-untyped-def]
            kinds.extend(request)
            return await real(self, timeout, **request)

        monkeypatch.setattr(cls, "call", acall)

    counted(Session)  # either transport: the gRPC Session stream or the session socket
    counted(SocketSession)
    acounted(AsyncSession)
    acounted(AsyncSocketSession)
    return kinds


@pytest.mark.parametrize("session_puts", [True, False])
def test_client_put_of_a_device_tensor(dev_server: Server, monkeypatch, session_puts) -> None:
    """One PutFromDevice per CUDA tensor: on the session stream, or as an RPC where the
    daemon does not take puts there (one from before they could)."""
    engine, service, fake = dev_server
    src = blob(3 * PAGE + 11, 5)
    fake_cuda_puts(monkeypatch, fake, {id(src)})
    calls: list[str] = []
    real = grpc_device_puts.put_from_device

    async def counting(puts, request, owner, quota):  # type: ignore[no-untyped-def]
        calls.append(request.key)
        return await real(puts, request, owner, quota)

    # The daemon's device put, whether a session call or an RPC asks for it.
    monkeypatch.setattr(grpc_device_puts, "put_from_device", counting)
    kinds = session_calls(monkeypatch)
    with EmbCacheClient(f"unix:{service.socket_path}", timeout=10) as client:
        client._conn.open_session().serves_device_puts = session_puts
        assert client.put("one", src) is True and client.put("one", src) is False
        with client.get(["one"]) as [got]:  # a copy out of the read table: no call
            assert got is not None and torch.equal(got, src)
        with client.get(["one"], zero_copy=True) as [got]:
            assert got is not None and torch.equal(got, src)
        del got  # the view is gone: closing the client releases its lease
    assert calls == ["one", "one"]  # both reached the daemon's device put
    assert kinds == ["put_from_device"] * 2 * session_puts + ["get", "release"]
    assert engine.stats().entries_filling == 0


def test_client_put_many_streams_when_the_daemon_cannot_read_the_gpu(
    dev_server: Server, monkeypatch
) -> None:
    engine, service, fake = dev_server
    tensors = {"d0": blob(5000, 1), "d1": blob(300, 2)}
    fake_cuda_puts(monkeypatch, fake, {id(t) for t in tensors.values()})
    monkeypatch.setattr(fake, "available", lambda: False)  # a daemon without CUDA
    with EmbCacheClient(f"unix:{service.socket_path}", timeout=10) as client:
        assert client.put_many(tensors) == [True, True]
        assert not client._state.caps.device_puts  # later puts stream at once
        with pytest.raises(ValueError, match="more than once"):
            client.put_many([("x", tensors["d0"]), ("x", tensors["d1"])])
    assert engine.exists(["d0", "d1", "x"]) == [True, True, False]


# -- GetInto ---------------------------------------------------------------------------------
def test_get_into_packs_and_copies(dev_server: Server, stub) -> None:
    engine, _, fake = dev_server
    data = {"a": blob(1000, 1), "b": blob(3 * PAGE + 5, 2), "c": blob(77, 3)}
    for key, t in data.items():
        engine.put(key, t)
    engine.device.get(["b"], "warm")  # b is copied from the device pool, the rest from host
    buf = torch.full((MiB,), 0xAB, dtype=torch.uint8)
    handle = fake.register(buf)
    dest = pb.CudaIpcTensor(
        gpu_uuid=FAKE_GPU,
        ipc_handle=handle,
        offset=512,
        alloc_size=MiB,
        dtype="uint8",
        shape=[MiB - 512],
        event_handle=b"v" * 64,
    )
    keys = ["a", "miss", "b", "c"]
    reply = stub.GetInto(pb.GetIntoRequest(keys=keys, destination=pb.DeviceBuffer(buffer=dest)))
    got = into.into_results(reply)
    assert [r.found for r in got] == [True, False, True, True]
    want = into.pack_offsets([1000, None, 3 * PAGE + 5, 77])
    assert [r.offset for r in got if r] == [want[0], want[2], want[3]] == [0, 1008, 197632]
    assert got[2].shape == (3 * PAGE + 5,) and got[2].dtype == "uint8"
    written = torch.zeros(MiB, dtype=torch.bool)
    for r in got:
        if r:
            lo = 512 + r.offset
            assert torch.equal(buf[lo : lo + r.nbytes], data[r.key])
            written[lo : lo + r.nbytes] = True
    assert (buf[~written] == 0xAB).all()  # nothing else was touched
    assert fake.events == [b"v" * 64] and len(fake.opened) == 1
    assert engine.stats().leases_active == 1  # only the warm-up lease
    stub.GetInto(  # explicit offsets
        pb.GetIntoRequest(keys=["c"], destination=pb.DeviceBuffer(buffer=dest), offsets=[3])
    )
    assert torch.equal(buf[515 : 515 + 77], data["c"]) and len(fake.opened) == 1
    for offsets in ([0, 500], [0]):  # overlapping slots; not one offset per key
        req = pb.GetIntoRequest(keys=["a", "c"], offsets=offsets)
        req.destination.buffer.CopyFrom(dest)
        with pytest.raises(grpc.RpcError) as err:
            stub.GetInto(req)
        assert err.value.code() == C.INVALID_ARGUMENT
    assert engine.stats().leases_active == 1


def test_get_into_as_a_session_call(dev_server: Server) -> None:
    """GetInto in the session (the session socket's call, as the client sends it): the same
    copies, offsets and errors as the RPC, and the session's leases end with the call."""
    from embcache.clients._backends.sync_socket_session import SocketSession
    from embcache.clients.core.targets import session_socket_path

    engine, service, fake = dev_server
    data = {"a": blob(1000, 1), "c": blob(77, 3)}
    for key, t in data.items():
        engine.put(key, t)
    buf = torch.zeros(MiB, dtype=torch.uint8)
    dest = pb.CudaIpcTensor(gpu_uuid=FAKE_GPU, ipc_handle=fake.register(buf), offset=0,
                            alloc_size=MiB, dtype="uint8", shape=[MiB])  # fmt: skip
    lane = session_socket_path(f"unix:{service.socket_path}")
    assert lane is not None
    session = SocketSession(lane, None, "into", 10)
    try:
        assert session.serves_get_into
        request = pb.GetIntoRequest(
            keys=["a", "miss", "c"], destination=pb.DeviceBuffer(buffer=dest)
        )
        result = session.call(10, get_into=request)
        got = into.into_results(result.get_into)
        assert [r.found for r in got] == [True, False, True]
        for r in got:
            if r:
                assert torch.equal(buf[r.offset : r.offset + r.nbytes], data[r.key])
        bad = pb.GetIntoRequest(keys=["a", "c"], offsets=[0, 500])  # overlapping slots
        bad.destination.buffer.CopyFrom(dest)
        assert session.call(10, get_into=bad).error.code == "INVALID_ARGUMENT"
        assert engine.stats().leases_active == 0
    finally:
        session.close()
    metrics = service.servicer.metrics
    if metrics is not None and hasattr(metrics, "by_transport"):
        assert ("lane", "Session.GetInto", "OK") in metrics.by_transport


def into_paths(monkeypatch, service: DataPlane) -> list[str]:  # type: ignore[no-untyped-def]
    """Which way each GetInto from now on ran: "loop" or "thread"."""
    plane = service.servicer.device
    paths: list[str] = []
    now, waiting = plane._into_now, plane._into_waiting

    async def on_loop(*args):  # type: ignore[no-untyped-def]
        paths.append("loop")
        return await now(*args)

    def in_thread(*args):  # type: ignore[no-untyped-def]
        paths.append("thread")
        return waiting(*args)

    monkeypatch.setattr(plane, "_into_now", on_loop)
    monkeypatch.setattr(plane, "_into_waiting", in_thread)
    return paths


def test_get_into_runs_on_the_loop_once_nothing_can_block(dev_server: Server, monkeypatch) -> None:
    """The first GetInto of a session maps the buffer and opens the client's event in a
    worker thread; later ones, with both open, copy on the loop. An event that has not
    fired yet is polled there, and the copies start only once it has fired. A new event
    (not open yet) sends the call back to a thread. Either way the bytes land at their
    slots and no lease outlives the call."""
    from embcache.clients.core.targets import session_socket_path

    engine, service, fake = dev_server
    data = {"a": blob(1000, 1), "b": blob(2 * PAGE + 3, 2)}
    for key, t in data.items():
        engine.put(key, t)
    engine.device.get(["b"], "warm")  # b from the device pool, a from the host pool
    buf = torch.zeros(MiB, dtype=torch.uint8)
    event = os.urandom(64)
    dest = pb.CudaIpcTensor(gpu_uuid=FAKE_GPU, ipc_handle=fake.register(buf), offset=64,
                            alloc_size=MiB, dtype="uint8", shape=[MiB - 64],
                            event_handle=event)  # fmt: skip
    paths = into_paths(monkeypatch, service)
    lane = session_socket_path(f"unix:{service.socket_path}")
    assert lane is not None
    session = SocketSession(lane, None, "into-loop", 10)
    try:

        def call(offsets: list[int]) -> pb.SessionResult:
            buf.zero_()
            request = pb.GetIntoRequest(keys=["b", "miss", "a"], offsets=offsets)
            request.destination.buffer.CopyFrom(dest)
            return session.call(10, get_into=request)

        fired_at_start: list[bool] = []  # per call: had the client's event fired?
        start_into = engine.device.start_into

        def watched(*args, **kwargs):  # type: ignore[no-untyped-def]
            fired_at_start.append(dest.event_handle not in fake.unfired)
            return start_into(*args, **kwargs)

        monkeypatch.setattr(engine.device, "start_into", watched)
        for round_ in ("first", "fired", "unfired", "fired", "new event"):
            fake.unfired = {dest.event_handle} if round_ == "unfired" else set()
            if round_ == "unfired":  # the client's work on the buffer ends 50 ms later
                threading.Timer(0.05, fake.unfired.clear).start()
            if round_ == "new event":
                dest.event_handle = os.urandom(64)
            got = into.into_results(call([0, 0, 3 * PAGE]).get_into)
            assert [r.found for r in got] == [True, False, True]
            for r in got:
                if r:
                    lo = 64 + r.offset
                    assert torch.equal(buf[lo : lo + r.nbytes], data[r.key])
            assert engine.stats().leases_active == 1  # only the warm-up lease
        assert paths == ["thread", "loop", "loop", "loop", "thread"]
        assert fired_at_start == [True] * 5  # never copied before the client's work ended
        assert len(fake.opened) == 1 and fake.event_opens == [event, dest.event_handle]
        # a bad slot found on the loop: typed error, nothing copied, no lease left
        fake.unfired = set()
        bad = call([0, 0, 100])  # a's slot overlaps b's
        assert bad.error.code == "INVALID_ARGUMENT" and paths[-1] == "loop"
        assert not buf.any() and engine.stats().leases_active == 1
    finally:
        session.close()


def test_a_get_into_cancelled_on_the_loop_ends_its_leases_after_its_copies(
    dev_server: Server, stub, monkeypatch
) -> None:
    """A GetInto whose copies are still running when its caller gives up (a deadline)
    keeps its leases, and the destination mapped, until the copies are complete; then
    nothing is left behind."""
    engine, service, fake = dev_server
    engine.put("a", blob(3000, 4))
    buf = torch.zeros(MiB, dtype=torch.uint8)
    dest = pb.CudaIpcTensor(gpu_uuid=FAKE_GPU, ipc_handle=fake.register(buf), offset=0,
                            alloc_size=MiB, dtype="uint8", shape=[MiB])  # fmt: skip
    request = pb.GetIntoRequest(keys=["a"], destination=pb.DeviceBuffer(buffer=dest))
    paths = into_paths(monkeypatch, service)
    stub.GetInto(request)  # maps the buffer (in a thread)
    copied = threading.Event()
    leases_at_copy_end: list[int] = []

    class SlowCopy:  # the copies' completion event, 0.6 s after they are queued
        def query(self) -> bool:
            return copied.is_set()

        def synchronize(self) -> None:
            copied.wait(5)

    copier = engine.device._tier.copier
    monkeypatch.setattr(copier, "record", lambda stream: SlowCopy())

    def finish_copies() -> None:
        leases_at_copy_end.append(engine.stats().leases_active)
        copied.set()

    timer = threading.Timer(0.6, finish_copies)
    timer.start()
    try:
        with pytest.raises(grpc.RpcError) as err:
            stub.GetInto(request, timeout=0.2)
        assert err.value.code() == C.DEADLINE_EXCEEDED
        assert paths == ["thread", "loop"]
        assert wait_for(lambda: bool(leases_at_copy_end) and engine.stats().leases_active == 0)
        assert leases_at_copy_end == [1]  # the lease lived until the copies were done
    finally:
        timer.cancel()
        copied.set()
    assert engine.stats().leases_active == 0


def test_client_get_into_a_host_buffer(dev_server: Server) -> None:
    engine, service, _ = dev_server
    a, c = torch.randn(10, 3), torch.arange(7, dtype=torch.int16)
    engine.put("a", a)
    engine.put("c", c)
    out = torch.zeros(4096, dtype=torch.uint8)
    with EmbCacheClient(f"unix:{service.socket_path}", timeout=10) as client:
        got = client.get_into(["a", "x", "c"], out)
        assert [bool(r) for r in got] == [True, False, True]
        assert got[2].offset == 128  # 120 bytes of a, aligned up to 16
        assert torch.equal(got[0].view(out), a) and torch.equal(got[2].view(out), c)
        client.get_into(["c"], out, offsets=[1000])
        assert torch.equal(out[1000:1014].view(torch.int16), c)
        with pytest.raises(ValueError, match="overlap"):
            client.get_into(["a", "c"], out, offsets=[0, 8])
        with pytest.raises(ValueError, match="one per key"):
            client.get_into(["a", "c"], out, offsets=[0])
        assert client.get_into(["a"], [torch.empty(10, 3)]) == [True]  # the list form
    assert engine.stats().leases_active == 0


def test_client_checks_device_replies() -> None:
    fd = pb.PoolHandle(
        pool_id="dev0-x",
        device=pb.DevicePool(
            gpu_uuid="GPU-1",
            size=4 * PAGE,
            page_bytes=PAGE,
            posix_fd=pb.PosixFdHandle(fd_token=9, alloc_size=8 * PAGE, fd_socket="/run/x.fds"),
        ),
    )
    handle = dr.pool_handle(fd)
    assert (handle.nbytes, handle.fd_socket, handle.fd_token) == (8 * PAGE, "/run/x.fds", 9)
    legacy = pb.PoolHandle(
        pool_id="dev0-y",
        device=pb.DevicePool(gpu_uuid="GPU-1", size=4 * PAGE, page_bytes=PAGE, ipc_handle=b"h"),
    )
    assert dr.pool_handle(legacy).ipc_handle == b"h"
    pool = DevicePool(torch.device("cpu"), 4 * PAGE, PAGE)
    reply = pb.GetResponse(pools=[fd])
    meta = pb.TensorMeta(dtype="uint8", shape=[2 * PAGE], nbytes=2 * PAGE)
    for loc in (
        pb.DeviceLocation(pool_id="dev0-x", offset=3 * PAGE),  # runs past the pool
        pb.DeviceLocation(pool_id="dev0-x", pages=pb.PageList(page_ids=[0, 4])),
        pb.DeviceLocation(pool_id="dev0-x", pages=pb.PageList(page_ids=[1])),  # too few
    ):
        del reply.results[:]
        reply.results.append(pb.GetResult(key="k", found=True, meta=meta, lease_id=1, device=loc))
        fake = FakePools(pool)
        fake.pool.pool_id = "dev0-x"
        with pytest.raises(ValueError, match="outside the pool"):
            dr.decode_device_get(reply, fake)  # type: ignore[arg-type]
    # A bad page among several entries is named by its own key.
    good = pb.DeviceLocation(pool_id="dev0-x", pages=pb.PageList(page_ids=[0, 1]))
    bad = pb.DeviceLocation(pool_id="dev0-x", pages=pb.PageList(page_ids=[2, 7]))
    del reply.results[:]
    for key, loc in (("a", good), ("b", bad)):
        reply.results.append(pb.GetResult(key=key, found=True, meta=meta, lease_id=1, device=loc))
    with pytest.raises(ValueError, match="'b' has a location outside"):
        dr.decode_device_get(reply, fake)  # type: ignore[arg-type]
    # Metadata that does not match the entry's bytes is refused, not reshaped.
    for wrong in (
        pb.TensorMeta(dtype="float16", shape=[3], nbytes=8),
        pb.TensorMeta(dtype="float32", shape=[2 * PAGE], nbytes=2 * PAGE),
    ):
        del reply.results[:]
        reply.results.append(pb.GetResult(key="k", found=True, meta=wrong, lease_id=1, device=good))
        with pytest.raises(ValueError, match="does not fit its bytes"):
            dr.decode_device_get(reply, fake)  # type: ignore[arg-type]
