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
    for name in codegen.PROTO_FILES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(codegen.PROTO_ROOT / name, tmp_path / name)
    target = tmp_path / codegen.PROTO_FILES[0]
    assert codegen.is_stale(tmp_path)
    written = codegen.generate(tmp_path)
    # The messages only: the gRPC stub is derived from their descriptor (services.py).
    stems = [Path(name).stem for name in codegen.PROTO_FILES]
    assert {p.name for p in written} == {f"{s}_pb2{ext}" for s in stems for ext in (".py", ".pyi")}
    assert not (target.parent / "embcache_pb2_grpc.py").exists()
    # the modules import each other inside this package, never a top-level embcache.v1
    for path in written:
        for line in path.read_text().splitlines():
            assert not line.startswith("from embcache.v1"), (path.name, line)
    assert not codegen.is_stale(tmp_path) and codegen.generate(tmp_path) == []
    part = tmp_path / codegen.PROTO_FILES[-1]
    part.write_text(part.read_text() + "\n// changed\n")  # any part makes every stub stale
    assert codegen.is_stale(tmp_path)
    assert len(codegen.generate(tmp_path)) == len(written) and not codegen.is_stale(tmp_path)


def test_the_service_module_offers_every_message_of_the_contract() -> None:
    from embcache.proto.embcache.v1 import embcache_pb2 as pb

    files = [pb.DESCRIPTOR, *pb.DESCRIPTOR.public_dependencies]
    assert len(files) == len(codegen.PROTO_FILES)
    for file in files:
        assert file.package == "embcache.v1"
        for name, message in file.message_types_by_name.items():
            assert getattr(pb, name).DESCRIPTOR is message
            assert message.full_name == f"embcache.v1.{name}"
    service = pb.DESCRIPTOR.services_by_name["EmbeddingCache"]
    for method in service.methods:
        assert getattr(pb, method.input_type.name).DESCRIPTOR is method.input_type
        assert getattr(pb, method.output_type.name).DESCRIPTOR is method.output_type
    assert pb.EvictOutcome.Value("EVICTED") == pb.EVICTED


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
    # it imports each message from the module of the file that declares it
    text = path.read_text().replace(
        "from embcache.v1 import ", "from embcache.proto.embcache.v1 import "
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
    from embcache.v1 import embcache_pb2 as pb, embcache_pb2_grpc as rpc

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
    # Only the .proto files go to the other side, in their embcache/v1 layout: generate,
    # import and call from a fresh process (whose own embcache.v1 package comes first).
    protos, gen = tmp_path / "protos", tmp_path / "gen"
    for name in codegen.PROTO_FILES:
        (protos / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(codegen.PROTO_ROOT / name, protos / name)
    gen.mkdir()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{protos}",
            f"--python_out={gen}",
            f"--grpc_python_out={gen}",
            *(str(protos / name) for name in codegen.PROTO_FILES),
        ],
        check=True,
        timeout=60,
    )
    (gen / "embcache" / "__init__.py").touch()
    (gen / "embcache" / "v1" / "__init__.py").touch()
    (gen / "client.py").write_text(INDEPENDENT_CLIENT)
    for target in (f"unix:{server.service.socket_path}", f"127.0.0.1:{server.service.ports[0]}"):
        done = subprocess.run(
            [sys.executable, str(gen / "client.py"), target],
            cwd=gen,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert "interop ok" in done.stdout
