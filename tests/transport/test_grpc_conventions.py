"""What standard gRPC tools and clients expect of the server: reflection under v1 and
v1alpha, counters that stay integers, the daemon's version in initial metadata, and
``freed_bytes`` that means the same over gRPC and REST, by key or by bytes."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import torch
from grpc_reflection.v1alpha import reflection_pb2

from embcache import build_info
from embcache.clients import EmbCacheClient
from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.proto.embcache.v1 import services as pb_grpc
from embcache.service.config import Settings
from embcache.service.engine import CacheEngine
from embcache.service.observability.metrics import Metrics
from embcache.service.transport.http.app import create_app
from embcache.service.transport.http.testing import serve_in_thread
from embcache.service.transport.serving import GrpcServerThread, serving

PAGE = 64 * 1024


@pytest.fixture
def server(shm_name: str) -> Iterator[tuple[CacheEngine, GrpcServerThread, str]]:
    with tempfile.TemporaryDirectory(prefix="ecv-") as d:
        settings = Settings(grpc_port=0, grpc_socket=Path(d) / "g.sock", shm_name=shm_name,
                            host_pool_bytes=16 * PAGE, page_bytes=PAGE)  # fmt: skip
        with serving(settings) as (engine, thread):
            assert thread.service is not None
            yield engine, thread, f"127.0.0.1:{thread.service.ports[0]}"


def _reflect(channel: grpc.Channel, service: str, request: reflection_pb2.ServerReflectionRequest):
    # v1 and v1alpha share their messages' fields and numbers: v1alpha's classes encode both.
    call = channel.stream_stream(
        f"/{service}/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    return next(iter(call(iter([request]), timeout=10)))


@pytest.mark.parametrize("package", ["grpc.reflection.v1", "grpc.reflection.v1alpha"])
def test_reflection_v1_and_v1alpha(server, package: str) -> None:
    _, _, target = server
    service = f"{package}.ServerReflection"
    with grpc.insecure_channel(target) as channel:
        listed = _reflect(
            channel, service, reflection_pb2.ServerReflectionRequest(list_services="")
        )
        names = {s.name for s in listed.list_services_response.service}
        assert {"embcache.v1.EmbeddingCache", "grpc.health.v1.Health", service} <= names
        assert {"grpc.reflection.v1.ServerReflection"} <= names
        # A tool resolves every listed service, the reflection service itself included.
        for symbol in ("embcache.v1.EmbeddingCache", "grpc.reflection.v1.ServerReflection"):
            req = reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol)
            reply = _reflect(channel, service, req)
            assert reply.WhichOneof("message_response") == "file_descriptor_response", reply
            assert reply.file_descriptor_response.file_descriptor_proto


def test_stats_counts_are_integers_and_carry_the_version(server) -> None:
    engine, _, target = server
    engine.put("a", torch.ones(16, dtype=torch.uint8))
    engine.host_store._t.counters["put_bytes"] = 2**60 + 1  # past a double's 53-bit mantissa
    with grpc.insecure_channel(target) as channel:
        call = pb_grpc.EmbeddingCacheStub(channel).Stats.with_call(pb.StatsRequest())
        reply, rpc = call
    doc = json.loads(reply.stats_json)
    assert doc["put_bytes"] == 2**60 + 1 and isinstance(doc["entries_ready"], int)
    assert doc["version"] == build_info.version() and doc["commit"] == build_info.git_commit()
    assert reply.stats["put_bytes"] != 2**60 + 1  # the Struct of older clients rounds it
    assert ("embcache-version", build_info.describe()) in tuple(rpc.initial_metadata())
    with EmbCacheClient(target) as client:
        stats = client.stats()
    assert stats["put_bytes"] == 2**60 + 1 and stats["version"] == build_info.version()
    assert isinstance(stats["hit_rate"], float) and stats["grpc_sessions"] >= 0


def test_session_stream_names_the_version(server) -> None:
    _, _, target = server
    with grpc.insecure_channel(target) as channel:
        stream = pb_grpc.EmbeddingCacheStub(channel).Session(
            iter([pb.SessionRequest(hello=pb.SessionHello(client_name="t"))])
        )
        assert ("embcache-version", build_info.describe()) in tuple(stream.initial_metadata())
        first = next(stream)
        assert first.opened.daemon_version == build_info.version()
        stream.cancel()


def test_freed_bytes_agree_by_key_and_by_bytes_over_grpc_and_rest(server) -> None:
    """One 64-byte entry in 64 KiB pages frees one page, however it is evicted."""
    engine, _, target = server
    app = create_app(engine, engine.settings, Metrics(engine))
    small = torch.ones(64, dtype=torch.uint8)
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=10) as http:
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.EmbeddingCacheStub(channel)
            engine.put("g1", small)
            assert stub.Evict(pb.EvictRequest(keys=["g1"])).freed_bytes == PAGE
            engine.put("g2", small)
            engine.put("g3", small)
            assert stub.Evict(pb.EvictRequest(keys=["g2", "g3", "x"])).freed_bytes == 2 * PAGE
        engine.put("r1", small)
        assert http.post("/v1/evict", json={"keys": ["r1"]}).json()["freed_bytes"] == PAGE
        engine.put("r2", small)
        assert http.post("/v1/evict", json={"bytes": 1}).json()["freed_bytes"] == PAGE
        engine.put("r3", small)
        assert http.delete("/v1/entries/r3").json()["freed_bytes"] == PAGE
