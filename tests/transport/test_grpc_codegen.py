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
    assert {p.name for p in written} == {
        "embcache_pb2.py",
        "embcache_pb2.pyi",
        "embcache_pb2_grpc.py",
    }
    assert not codegen.is_stale(tmp_path) and codegen.generate(tmp_path) == []
    grpc_stub = (target.parent / "embcache_pb2_grpc.py").read_text()
    assert "from . import embcache_pb2 as" in grpc_stub  # importable inside embcache.proto
    target.write_text(target.read_text() + "\n// changed\n")
    assert codegen.is_stale(tmp_path)
    assert len(codegen.generate(tmp_path)) == 3 and not codegen.is_stale(tmp_path)


def test_installed_stubs_are_current() -> None:
    assert not codegen.is_stale()


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
