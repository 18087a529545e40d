"""The wire contract: stub generation and a client generated independently from the .proto."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from embcache.proto import codegen
from embcache.service.config import Settings
from embcache.service.transport.serving import GrpcServerThread, serving

PROTO = codegen.PROTO_ROOT / codegen.PROTO_FILES[0]


def test_stubs_regenerate_when_missing_or_stale(tmp_path: Path) -> None:
    target = tmp_path / codegen.PROTO_FILES[0]
    target.parent.mkdir(parents=True)
    shutil.copy(PROTO, target)
    assert codegen.is_stale(tmp_path)
    written = codegen.generate(tmp_path)
    # The messages only: the gRPC stub is derived from their descriptor (services.py).
    assert {p.name for p in written} == {"embcache_pb2.py", "embcache_pb2.pyi"}
    assert not (target.parent / "embcache_pb2_grpc.py").exists()
    assert not codegen.is_stale(tmp_path) and codegen.generate(tmp_path) == []
    target.write_text(target.read_text() + "\n// changed\n")
    assert codegen.is_stale(tmp_path)
    assert len(codegen.generate(tmp_path)) == 2 and not codegen.is_stale(tmp_path)


def test_installed_stubs_are_current() -> None:
    assert not codegen.is_stale()


class _Recorder:
    """A channel or a server that records what a stub or a registration asks of it."""

    def __init__(self) -> None:
        self.calls: dict[str, tuple[object, ...]] = {}
        self.registered: dict[str, dict[str, object]] = {}
        self.generic: list[object] = []

    def _call(self, kind: str) -> object:
        def call(path, request_serializer=None, response_deserializer=None, **kw):
            self.calls[path] = (kind, request_serializer, response_deserializer, kw)
            return (kind, path)

        return call

    def __getattr__(self, name: str) -> object:
        if name in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            return self._call(name)
        raise AttributeError(name)

    def add_generic_rpc_handlers(self, handlers) -> None:
        self.generic.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers) -> None:
        self.registered[service] = dict(handlers)


class _Context:
    def __init__(self) -> None:
        self.code = self.details = None

    def set_code(self, code) -> None:
        self.code = code

    def set_details(self, details) -> None:
        self.details = details


def _grpc_tools_module(tmp_path: Path):
    """What grpcio-tools generates for the service, bound to embcache's own messages module
    (a second copy of the messages would clash in the descriptor pool)."""
    import importlib.util

    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{codegen.PROTO_ROOT}",
            f"--grpc_python_out={tmp_path}",
            str(PROTO),
        ],
        check=True,
        timeout=60,
    )
    path = tmp_path / "embcache" / "v1" / "embcache_pb2_grpc.py"
    text = path.read_text().replace(
        "from embcache.v1 import embcache_pb2 as",
        "from embcache.proto.embcache.v1 import embcache_pb2 as",
    )
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("_generated_pb2_grpc", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_derived_stub_and_registration_match_grpc_tools(tmp_path: Path) -> None:
    """The hand-written services module asks a channel and a server for exactly what the
    generated one asks: paths, call kinds, (de)serializers, handlers."""
    import grpc

    from embcache.proto.embcache.v1 import services

    generated = _grpc_tools_module(tmp_path)
    ours, theirs = _Recorder(), _Recorder()
    services.EmbeddingCacheStub(ours)
    generated.EmbeddingCacheStub(theirs)
    assert ours.calls == theirs.calls and len(ours.calls) == len(services.METHODS) > 10
    stub = services.EmbeddingCacheStub(ours)
    assert stub.Get == ("unary_unary", "/embcache.v1.EmbeddingCache/Get")
    with pytest.raises(AttributeError, match="no method 'Nope'"):
        _ = stub.Nope

    servicer = services.EmbeddingCacheServicer()
    ours, theirs = _Recorder(), _Recorder()
    services.add_servicer_to_server(servicer, ours)
    generated.add_EmbeddingCacheServicer_to_server(servicer, theirs)
    assert ours.registered == theirs.registered
    assert set(ours.registered["embcache.v1.EmbeddingCache"]) == {m.name for m in services.METHODS}
    assert [h.service_name() for h in ours.generic] == ["embcache.v1.EmbeddingCache"]

    base = generated.EmbeddingCacheServicer
    names = [n for n in vars(base) if not n.startswith("_")]
    assert names == [m.name for m in services.METHODS]
    for name in names:
        context = _Context()
        with pytest.raises(NotImplementedError):
            getattr(servicer, name)(None, context)
        assert (context.code, context.details) == (
            grpc.StatusCode.UNIMPLEMENTED,
            "Method not implemented!",
        )


INDEPENDENT_CLIENT = textwrap.dedent(
    """
    import sys, threading, zlib
    import grpc
    import embcache_pb2 as pb, embcache_pb2_grpc as rpc

    target = sys.argv[1]
    data = bytes(range(256)) * 5000  # 1.28 MB: two chunks
    with grpc.insecure_channel(target) as channel:
        stub = rpc.EmbeddingCacheStub(channel)
        def messages():
            yield pb.PutRequest(header=pb.PutHeader(
                key="indep", dtype="uint8", shape=[len(data)], nbytes=len(data),
                checksum=zlib.crc32(data)))
            for i in range(0, len(data), 1 << 20):
                yield pb.PutRequest(chunk=data[i:i + (1 << 20)])
        assert stub.Put(messages()).created
        done = threading.Event()
        def session_requests():  # the session lives while this stream stays open
            yield pb.SessionRequest(hello=pb.SessionHello(client_name="x"))
            done.wait(30)
        session = stub.Session(session_requests())
        sid = next(session).opened.session_id
        reply = stub.Get(pb.GetRequest(keys=["indep", "none"]),
                         metadata=(("x-embcache-session", sid),))
        hit, miss = reply.results
        assert hit.found and not miss.found and hit.meta.nbytes == len(data)
        assert reply.pools[0].host_shm.segment_name
        # Release (and Renew) take the caller's own leases only: name the session.
        assert stub.Release(pb.ReleaseRequest(lease_ids=[hit.lease_id])).released == 0
        assert stub.Release(pb.ReleaseRequest(lease_ids=[hit.lease_id]),
                            metadata=(("x-embcache-session", sid),)).released == 1
        got = b"".join(m.chunk for m in stub.GetBytes(pb.GetBytesRequest(key="indep")))
        assert got == data
        assert list(stub.Exists(pb.ExistsRequest(keys=["indep"])).exists) == [True]
        assert stub.Evict(pb.EvictRequest(keys=["indep"])).results[0].outcome == pb.EVICTED
        assert stub.Stats(pb.StatsRequest()).stats["entries_ready"] == 0
        try:
            stub.Evict(pb.EvictRequest(keys=["indep"]))
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.NOT_FOUND
        else:
            raise AssertionError("evicting a missing key must fail")
        done.set()
        session.cancel()
    print("interop ok")
    """
)


@pytest.fixture
def server(shm_name: str) -> Iterator[GrpcServerThread]:
    with tempfile.TemporaryDirectory(prefix="eci-") as d:
        settings = Settings(
            grpc_port=0, grpc_socket=Path(d) / "i.sock", shm_name=shm_name, host_pool_bytes=4 << 20
        )
        with serving(settings) as (_, thread):
            yield thread


def test_independently_generated_client_interoperates(server, tmp_path: Path) -> None:
    # Only the .proto goes to the other side: generate, import and call from a fresh process.
    shutil.copy(PROTO, tmp_path / "embcache.proto")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{tmp_path}",
            f"--python_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            str(tmp_path / "embcache.proto"),
        ],
        check=True,
        timeout=60,
    )
    (tmp_path / "client.py").write_text(INDEPENDENT_CLIENT)
    for target in (f"unix:{server.service.socket_path}", f"127.0.0.1:{server.service.ports[0]}"):
        done = subprocess.run(
            [sys.executable, str(tmp_path / "client.py"), target],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert "interop ok" in done.stdout
