"""In-process gRPC server against a real engine: every RPC, sessions, cancellation, auth."""

from __future__ import annotations

import socket
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.proto.embcache.v1 import services as pb_grpc
from embcache.service.config import Settings
from embcache.service.engine import CacheEngine
from embcache.service.transport.serving import GrpcServerThread, serving

MiB = 1 << 20


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


class FakeMetrics:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []

    def observe_rpc(self, transport: str, method: str, code: str, seconds: float) -> None:
        assert seconds >= 0
        self.calls.append((transport, method, code))

    def observe_refusal(self, listener: str, reason: str) -> None:
        self.calls.append((listener, "refusal", reason))

    def observe_dropped_touch(self) -> None:
        self.calls.append(("lane", "touch", "dropped"))


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    # Unix socket paths are limited to ~107 bytes: pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="ecg-") as d:
        yield Path(d)


@pytest.fixture
def server(shm_name: str, sock_dir: Path) -> Iterator[tuple[CacheEngine, GrpcServerThread]]:
    settings = Settings(
        grpc_port=0,
        grpc_socket=sock_dir / "g.sock",
        shm_name=shm_name,
        host_pool_bytes=16 * MiB,
        page_bytes=64 * 1024,
    )
    with serving(settings, FakeMetrics()) as pair:
        yield pair


@pytest.fixture
def stub(server: tuple[CacheEngine, GrpcServerThread]) -> Iterator[pb_grpc.EmbeddingCacheStub]:
    service = server[1].service
    assert service is not None
    with grpc.insecure_channel(f"unix:{service.socket_path}") as channel:
        yield pb_grpc.EmbeddingCacheStub(channel)


def put_messages(key: str, data: bytes, dtype: str, shape: list[int], chunk: int = MiB):
    yield pb.PutRequest(
        header=pb.PutHeader(
            key=key, dtype=dtype, shape=shape, nbytes=len(data), checksum=zlib.crc32(data)
        )
    )
    for i in range(0, len(data), chunk):
        yield pb.PutRequest(chunk=data[i : i + chunk])


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def test_put_get_bytes_roundtrip(stub, server) -> None:
    engine, _ = server
    t = torch.randn(300, 1000).to(torch.bfloat16)  # 600 KB: several chunks of 100 KB
    data = tensor_bytes(t)
    reply = stub.Put(put_messages("a", data, "bfloat16", [300, 1000], chunk=100_000))
    assert reply.created and reply.nbytes == len(data)
    again = stub.Put(put_messages("a", data, "bfloat16", [300, 1000]))
    assert not again.created
    chunks = list(stub.GetBytes(pb.GetBytesRequest(key="a", chunk_bytes=65536)))
    assert chunks[0].WhichOneof("kind") == "meta"
    assert list(chunks[0].meta.shape) == [300, 1000] and chunks[0].meta.dtype == "bfloat16"
    assert b"".join(c.chunk for c in chunks[1:]) == data
    part = list(stub.GetBytes(pb.GetBytesRequest(key="a", offset=10, length=100)))
    assert b"".join(c.chunk for c in part[1:]) == data[10:110]
    assert engine.stats().leases_active == 0  # GetBytes released its lease


def test_get_locations_and_release(stub, server) -> None:
    engine, _ = server
    data = bytes(range(256)) * 1000
    stub.Put(put_messages("k", data, "uint8", [len(data)]))
    reply = stub.Get(pb.GetRequest(keys=["k", "missing"]))
    hit, miss = reply.results
    assert hit.found and not miss.found and miss.key == "missing"
    assert hit.WhichOneof("location") == "host"
    (pool,) = reply.pools
    assert pool.pool_id == hit.host.pool_id
    assert pool.host_shm.segment_name == engine.host_pool.name
    assert pool.host_shm.size == engine.host_pool.nbytes
    got = b"".join(
        bytes(engine.host_pool.array[r.offset : r.offset + r.length]) for r in hit.host.runs
    )
    assert got == data
    assert engine.stats().leases_active == 1
    assert stub.Renew(pb.RenewRequest(lease_ids=[hit.lease_id], ttl_s=5)).renewed == 1
    assert stub.Release(pb.ReleaseRequest(lease_ids=[hit.lease_id, 12345])).released == 1
    assert engine.stats().leases_active == 0


def test_exists_evict_stats(stub) -> None:
    for key in ("a", "b", "c"):
        stub.Put(put_messages(key, b"x" * 10, "uint8", [10]))
    assert list(stub.Exists(pb.ExistsRequest(keys=["a", "zz", "c"])).exists) == [True, False, True]
    lease = stub.Get(pb.GetRequest(keys=["b"])).results[0].lease_id
    reply = stub.Evict(pb.EvictRequest(keys=["a", "b", "nope"]))
    assert [r.outcome for r in reply.results] == [pb.EVICTED, pb.LEASED, pb.NOT_FOUND]
    with pytest.raises(grpc.RpcError) as leased:
        stub.Evict(pb.EvictRequest(keys=["b"]))
    assert leased.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert ("embcache-error", "EntryLeased") in tuple(leased.value.trailing_metadata())
    with pytest.raises(grpc.RpcError) as missing:
        stub.Evict(pb.EvictRequest(keys=["a"]))
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    stub.Release(pb.ReleaseRequest(lease_ids=[lease]))
    assert stub.Evict(pb.EvictRequest(keys=["b"])).results[0].outcome == pb.EVICTED
    stats = stub.Stats(pb.StatsRequest())
    assert stats.stats["entries_ready"] == 1 and stats.stats["host"]["page_bytes"] == 65536
    assert stats.sessions == 0


def test_cancelled_put_leaves_nothing(stub, server) -> None:
    engine, _ = server
    sent_one, finish = threading.Event(), threading.Event()

    def messages():
        yield pb.PutRequest(header=pb.PutHeader(key="half", dtype="uint8", shape=[4 * MiB]))
        yield pb.PutRequest(chunk=b"\1" * MiB)
        sent_one.set()
        finish.wait(10)

    future = stub.Put.future(messages())
    assert sent_one.wait(5)
    assert wait_for(lambda: engine.stats().entries_filling == 1)
    future.cancel()
    finish.set()
    assert wait_for(lambda: engine.stats().entries_filling == 0)
    stats = engine.stats()
    assert stats.reserved_filling_bytes == 0 and stats.puts_aborted == 1
    assert stats.host.free_pages == stats.host.total_pages
    assert stub.Exists(pb.ExistsRequest(keys=["half"])).exists == [False]


def test_put_past_its_deadline_is_aborted(stub, server) -> None:
    engine, _ = server
    finish = threading.Event()

    def messages():
        yield pb.PutRequest(header=pb.PutHeader(key="slow", dtype="uint8", shape=[2 * MiB]))
        yield pb.PutRequest(chunk=b"\1" * MiB)
        finish.wait(10)

    with pytest.raises(grpc.RpcError) as err:
        stub.Put(messages(), timeout=0.5)
    finish.set()
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_for(lambda: engine.stats().entries_filling == 0)
    assert engine.stats().puts_aborted == 1


def test_session_end_releases_its_leases(stub, server) -> None:
    engine, _ = server
    stub.Put(put_messages("s", b"abc", "uint8", [3]))
    requests: list[pb.SessionRequest] = []
    done = threading.Event()

    def session_requests():
        yield pb.SessionRequest(hello=pb.SessionHello(client_name="t", pid=1))
        yield pb.SessionRequest(ping=7)
        done.wait(10)

    call = stub.Session(session_requests())
    opened = next(call)
    assert opened.opened.session_id.startswith("session:")
    assert next(call).pong == 7
    md = (("x-embcache-session", opened.opened.session_id),)
    stub.Get(pb.GetRequest(keys=["s"]), metadata=md)
    stub.Get(pb.GetRequest(keys=["s"]), metadata=md)
    assert engine.stats().leases_active == 2
    assert stub.Stats(pb.StatsRequest()).sessions == 1
    call.cancel()
    done.set()
    assert wait_for(lambda: engine.stats().leases_active == 0)
    # The session is gone: naming it again is refused, and nothing leaks.
    with pytest.raises(grpc.RpcError) as err:
        stub.Get(pb.GetRequest(keys=["s"]), metadata=md)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert ("embcache-error", "UnknownSession") in tuple(err.value.trailing_metadata())
    assert engine.stats().leases_active == 0
    del requests


def test_device_paths_fail_cleanly_in_cpu_mode(stub) -> None:
    tensor = pb.CudaIpcTensor(gpu_uuid="GPU-0", ipc_handle=b"\0" * 64, dtype="float16", shape=[2])
    for call in (
        lambda: stub.PutFromDevice(pb.PutFromDeviceRequest(key="d", tensor=tensor)),
        lambda: stub.GetInto(
            pb.GetIntoRequest(keys=["d"], destination=pb.DeviceBuffer(buffer=tensor))
        ),
        lambda: stub.Get(pb.GetRequest(keys=["d"], gpu_uuid="GPU-0")),
    ):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert ("embcache-error", "DeviceUnavailable") in tuple(err.value.trailing_metadata())


def test_unexpected_error_is_internal(stub, server, monkeypatch, caplog) -> None:
    engine, _ = server

    def boom(keys):
        raise RuntimeError("bug")

    monkeypatch.setattr(engine, "exists", boom)
    with pytest.raises(grpc.RpcError) as err:
        stub.Exists(pb.ExistsRequest(keys=["a"]))
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert "Exists failed unexpectedly" in caplog.text


def test_metrics_record_each_call(stub, server) -> None:
    _, thread = server
    stub.Exists(pb.ExistsRequest(keys=["a"]))
    with pytest.raises(grpc.RpcError):
        stub.Evict(pb.EvictRequest(keys=["a"]))
    metrics = thread.service.servicer.metrics  # type: ignore[union-attr]
    assert ("grpc", "Exists", "OK") in metrics.calls
    # abort() sends the status before the handler unwinds: the record may trail the reply.
    assert wait_for(lambda: ("grpc", "Evict", "NOT_FOUND") in metrics.calls)


def test_health_and_reflection(server) -> None:
    _, thread = server
    service = thread.service
    assert service is not None
    with grpc.insecure_channel(f"127.0.0.1:{service.ports[0]}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", "embcache.v1.EmbeddingCache"):
            status = health.Check(health_pb2.HealthCheckRequest(service=name)).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        service.set_serving(False).result(5)
        status = health.Check(health_pb2.HealthCheckRequest(service="")).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        service.set_serving(True).result(5)
        db = ProtoReflectionDescriptorDatabase(channel)
        assert "embcache.v1.EmbeddingCache" in db.get_services()
        assert "grpc.health.v1.Health" in db.get_services()
        pool = descriptor_pool.DescriptorPool(db)
        put = pool.FindServiceByName("embcache.v1.EmbeddingCache").FindMethodByName("Put")
        assert put.client_streaming and put.input_type.full_name == "embcache.v1.PutRequest"


def test_auth_token_required_on_every_listener(shm_name: str, sock_dir: Path) -> None:
    settings = Settings(
        grpc_port=0,
        grpc_socket=sock_dir / "a.sock",
        shm_name=shm_name,
        host_pool_bytes=4 * MiB,
        auth_token="s3cret",
    )
    with serving(settings) as (_, thread):
        service = thread.service
        assert service is not None
        for target in (f"127.0.0.1:{service.ports[0]}", f"unix:{service.socket_path}"):
            with grpc.insecure_channel(target) as channel:
                stub = pb_grpc.EmbeddingCacheStub(channel)
                for md in (
                    (),
                    (("authorization", "Bearer wrong"),),
                    (("authorization", "s3cret"),),
                ):
                    with pytest.raises(grpc.RpcError) as err:
                        stub.Stats(pb.StatsRequest(), metadata=md)
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.RpcError) as err:
                    stub.Put(put_messages("k", b"ab", "uint8", [2]))
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                good = (("authorization", "Bearer s3cret"),)
                assert stub.Stats(pb.StatsRequest(), metadata=good).sessions == 0
                stub.Put(put_messages("k", b"ab", "uint8", [2]), metadata=good)
                # Health stays open for probes that cannot send metadata.
                health = health_pb2_grpc.HealthStub(channel)
                assert health.Check(health_pb2.HealthCheckRequest()).status == 1


def test_stale_socket_is_replaced_and_live_one_refused(shm_name: str, sock_dir: Path) -> None:
    path = sock_dir / "s.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()  # the file stays behind, nobody listens
    settings = Settings(grpc_port=0, grpc_socket=path, shm_name=shm_name, host_pool_bytes=4 * MiB)
    with serving(settings) as (engine, thread):
        assert thread.service is not None and thread.service.socket_path == path
        second = GrpcServerThread(engine, settings)
        with pytest.raises(OSError, match="another process is listening"):
            second.start()
        second.stop()
    assert not path.exists()  # removed on stop
    path.write_text("not a socket")
    other = settings.model_copy(update={"shm_name": shm_name + "x"})
    with pytest.raises(FileExistsError), serving(other):
        pass
