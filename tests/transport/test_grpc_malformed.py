"""Malformed requests, generated with hypothesis: the right status code every time.

Each kind builds raw request bytes (so even undecodable messages can be sent) and names the
status it must get. After every example the server must hold no reservation and no lease
beyond the fixture's own; at the end it must still be serving.
"""

from __future__ import annotations

import itertools
import math
import os
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from embcache.proto.embcache.v1 import embcache_pb2 as pb
from embcache.service.config import Settings
from embcache.service.engine import CacheEngine
from embcache.service.transport.serving import serving

MiB = 1 << 20
POOL = 8 * MiB
MAX_ENTRY = 32 * MiB
MAX_KEY = 64
C = grpc.StatusCode
SIZES = {"uint8": 1, "int8": 1, "float16": 2, "bfloat16": 2, "float32": 4, "int64": 8}
FIXED = "fixed-f16"  # float16 [4, 4], always present
LEASED = "fixed-leased"  # uint8 [8], always leased by the fixture


@dataclass
class Case:
    method: str
    kind: str  # unary | client_stream | server_stream | bidi
    messages: list[bytes]
    expected: grpc.StatusCode
    metadata: tuple[tuple[str, str], ...] = ()


Draw = Callable[[st.SearchStrategy], object]


# -- building blocks ---------------------------------------------------------------------
def varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def field(number: int, payload: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def keys() -> st.SearchStrategy[str]:
    return st.text(
        st.characters(min_codepoint=33, max_codepoint=0x2FFF), min_size=1, max_size=20
    ).map(lambda s: "m-" + s)


@st.composite
def metas(draw: Draw, max_bytes: int = 64 * 1024) -> tuple[str, list[int], int]:
    dtype = draw(st.sampled_from(sorted(SIZES)))
    ndim = draw(st.integers(1, 3))
    shape = [draw(st.integers(1, 16)) for _ in range(ndim)]
    nbytes = math.prod(shape) * SIZES[dtype]
    if nbytes > max_bytes:
        shape, nbytes = [max_bytes // SIZES[dtype]], (max_bytes // SIZES[dtype]) * SIZES[dtype]
    return dtype, shape, nbytes


def header(key: str, dtype: str, shape: list[int], nbytes: int | None = None, **kw) -> bytes:
    h = pb.PutHeader(key=key, dtype=dtype, shape=shape, **kw)
    if nbytes is not None:
        h.nbytes = nbytes
    return pb.PutRequest(header=h).SerializeToString()


def chunk(data: bytes) -> bytes:
    return pb.PutRequest(chunk=data).SerializeToString()


def put(messages: list[bytes], expected: grpc.StatusCode, **kw) -> Case:
    return Case("Put", "client_stream", messages, expected, **kw)


def unary(method: str, message: object, expected: grpc.StatusCode, **kw) -> Case:
    raw = message if isinstance(message, bytes) else message.SerializeToString()  # type: ignore[attr-defined]
    return Case(method, "unary", [raw], expected, **kw)


GARBAGE = st.binary(min_size=0, max_size=30).map(lambda b: b"\x0a\x7f" + b)  # field 1 cut short
BAD_UTF8 = st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"ok\xfe", b"\xe2\x82"])


@st.composite
def payload(draw: Draw) -> tuple[str, str, list[int], bytes]:
    dtype, shape, nbytes = draw(metas())
    data = draw(st.binary(min_size=nbytes, max_size=nbytes))
    return draw(keys()), dtype, shape, data


def split(draw: Draw, data: bytes) -> list[bytes]:
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=4)))
    bounds = [0, *cuts, len(data)]
    return [chunk(data[a:b]) for a, b in itertools.pairwise(bounds)]


# -- the kinds ---------------------------------------------------------------------------
KINDS: dict[str, Callable[[Draw], Case]] = {}


def kind(fn: Callable[[Draw], Case]) -> Callable[[Draw], Case]:
    KINDS[fn.__name__] = fn
    return fn


@kind
def put_empty_stream(draw: Draw) -> Case:
    return put([], C.INVALID_ARGUMENT)


@kind
def put_chunk_first(draw: Draw) -> Case:
    return put([chunk(draw(st.binary(max_size=64)))], C.INVALID_ARGUMENT)


@kind
def put_empty_message_first(draw: Draw) -> Case:
    return put([b"", *[chunk(b"x")] * draw(st.integers(0, 2))], C.INVALID_ARGUMENT)


@kind
def put_garbage_first(draw: Draw) -> Case:
    return put([draw(GARBAGE)], C.INVALID_ARGUMENT)


@kind
def put_empty_key(draw: Draw) -> Case:
    dtype, shape, nbytes = draw(metas())
    return put([header("", dtype, shape), chunk(b"\0" * nbytes)], C.INVALID_ARGUMENT)


@kind
def put_key_too_long(draw: Draw) -> Case:
    key = draw(
        st.text(
            st.characters(min_codepoint=97, max_codepoint=122), min_size=MAX_KEY + 1, max_size=300
        )
    )
    return put([header(key, "uint8", [1]), chunk(b"\0")], C.INVALID_ARGUMENT)


@kind
def put_key_multibyte_too_long(draw: Draw) -> Case:
    key = "é" * draw(st.integers(MAX_KEY // 2 + 1, 100))  # few characters, too many bytes
    return put([header(key, "uint8", [1]), chunk(b"\0")], C.INVALID_ARGUMENT)


@kind
def put_key_with_nul(draw: Draw) -> Case:
    key = draw(keys()) + "\0" + draw(st.text(max_size=5))
    return put([header(key, "uint8", [1]), chunk(b"\0")], C.INVALID_ARGUMENT)


@kind
def put_key_invalid_utf8(draw: Draw) -> Case:
    rest = pb.PutHeader(dtype="uint8", shape=[1]).SerializeToString()
    raw = field(1, field(1, b"k" + draw(BAD_UTF8)) + rest)
    return put([raw, chunk(b"\0")], C.INVALID_ARGUMENT)


@kind
def put_unknown_dtype(draw: Draw) -> Case:
    known = {*SIZES, "float64", "int16", "int32", "bool", "float8_e4m3fn", "float8_e5m2"}
    known |= {"bf16", "fp16", "half", "fp32", "float", "fp64", "double"}
    dtype = draw(st.text(min_size=1, max_size=12).filter(lambda s: s not in known))
    return put([header(draw(keys()), dtype, [2]), chunk(b"\0\0")], C.INVALID_ARGUMENT)


@kind
def put_empty_dtype(draw: Draw) -> Case:
    return put([header(draw(keys()), "", [2]), chunk(b"\0\0")], C.INVALID_ARGUMENT)


@kind
def put_torch_prefixed_dtype(draw: Draw) -> Case:
    dtype = "torch." + draw(st.sampled_from(sorted(SIZES)))
    return put([header(draw(keys()), dtype, [2])], C.INVALID_ARGUMENT)


@kind
def put_negative_dim(draw: Draw) -> Case:
    dtype, shape, _ = draw(metas())
    shape[draw(st.integers(0, len(shape) - 1))] = draw(st.integers(-(2**62), -1))
    return put([header(draw(keys()), dtype, shape)], C.INVALID_ARGUMENT)


@kind
def put_too_many_dims(draw: Draw) -> Case:
    shape = [1] * draw(st.integers(9, 20))
    return put([header(draw(keys()), "uint8", shape), chunk(b"\0")], C.INVALID_ARGUMENT)


@kind
def put_nbytes_too_large(draw: Draw) -> Case:
    dtype, shape, nbytes = draw(metas())
    extra = draw(st.integers(1, 2**40))
    return put([header(draw(keys()), dtype, shape, nbytes + extra)], C.INVALID_ARGUMENT)


@kind
def put_nbytes_too_small(draw: Draw) -> Case:
    dtype, shape, nbytes = draw(metas())
    small = draw(st.integers(0, nbytes - 1))
    return put(
        [header(draw(keys()), dtype, shape, small), chunk(b"\0" * small)], C.INVALID_ARGUMENT
    )


@kind
def put_nbytes_for_empty_shape(draw: Draw) -> Case:
    shape = [0, draw(st.integers(1, 100))]
    return put(
        [header(draw(keys()), "float32", shape, draw(st.integers(1, 400)))], C.INVALID_ARGUMENT
    )


@kind
def put_shape_overflows(draw: Draw) -> Case:
    shape = [draw(st.integers(2**32, 2**62)) for _ in range(draw(st.integers(2, 4)))]
    return put([header(draw(keys()), "float32", shape)], C.INVALID_ARGUMENT)


@kind
def put_larger_than_max_entry(draw: Draw) -> Case:
    n = draw(st.integers(MAX_ENTRY + 1, 2**40))
    return put([header(draw(keys()), "uint8", [n])], C.RESOURCE_EXHAUSTED)


@kind
def put_larger_than_pool(draw: Draw) -> Case:
    n = draw(st.integers(POOL + 1, MAX_ENTRY))
    return put([header(draw(keys()), "uint8", [n])], C.RESOURCE_EXHAUSTED)


@kind
def put_checksum_mismatch(draw: Draw) -> Case:
    key, dtype, shape, data = draw(payload())
    crc = draw(st.integers(0, 2**32 - 1).filter(lambda c: c != zlib.crc32(data)))
    return put([header(key, dtype, shape, checksum=crc), *split(draw, data)], C.INVALID_ARGUMENT)


@kind
def put_corrupted_payload(draw: Draw) -> Case:
    key, dtype, shape, data = draw(payload())
    i = draw(st.integers(0, len(data) - 1))
    bad = data[:i] + bytes([data[i] ^ draw(st.integers(1, 255))]) + data[i + 1 :]
    messages = [header(key, dtype, shape, checksum=zlib.crc32(data)), *split(draw, bad)]
    return put(messages, C.INVALID_ARGUMENT)


@kind
def put_too_many_bytes_in_one_chunk(draw: Draw) -> Case:
    key, dtype, shape, data = draw(payload())
    extra = draw(st.binary(min_size=1, max_size=100))
    return put([header(key, dtype, shape), chunk(data + extra)], C.INVALID_ARGUMENT)


@kind
def put_too_many_bytes_across_chunks(draw: Draw) -> Case:
    key, dtype, shape, data = draw(payload())
    extra = draw(st.binary(min_size=1, max_size=100))
    return put([header(key, dtype, shape), *split(draw, data), chunk(extra)], C.INVALID_ARGUMENT)


@kind
def put_too_few_bytes(draw: Draw) -> Case:
    key, dtype, shape, data = draw(payload())
    cut = draw(st.integers(0, len(data) - 1))
    return put([header(key, dtype, shape), *split(draw, data[:cut])], C.INVALID_ARGUMENT)


@kind
def put_header_only(draw: Draw) -> Case:
    key, dtype, shape, _ = draw(payload())
    return put([header(key, dtype, shape)], C.INVALID_ARGUMENT)


@kind
def put_second_header(draw: Draw) -> Case:
    key, dtype, shape, data = draw(payload())
    first = header(key, dtype, shape)
    return put([first, first, *split(draw, data)], C.INVALID_ARGUMENT)


@kind
def put_header_after_chunks(draw: Draw) -> Case:
    key, dtype, shape, data = draw(payload())
    first = header(key, dtype, shape)
    return put([first, *split(draw, data), first], C.INVALID_ARGUMENT)


@kind
def put_empty_message_among_chunks(draw: Draw) -> Case:
    key, dtype, shape, data = draw(payload())
    parts = split(draw, data)
    parts.insert(draw(st.integers(0, len(parts))), b"")
    return put([header(key, dtype, shape), *parts], C.INVALID_ARGUMENT)


@kind
def put_garbage_among_chunks(draw: Draw) -> Case:
    key, dtype, shape, data = draw(payload())
    parts = split(draw, data)
    parts.insert(draw(st.integers(0, len(parts))), draw(GARBAGE))
    return put([header(key, dtype, shape), *parts], C.INVALID_ARGUMENT)


@kind
def put_chunk_with_wrong_wire_type(draw: Draw) -> Case:
    key, dtype, shape, data = draw(payload())
    wrong = varint(2 << 3 | 0) + varint(draw(st.integers(0, 2**40)))  # field 2 as a varint
    return put([header(key, dtype, shape), wrong, *split(draw, data)], C.INVALID_ARGUMENT)


@kind
def put_chunk_over_1mib(draw: Draw) -> Case:
    size = MiB + draw(st.integers(1, 64 * 1024))
    return put([header(draw(keys()), "uint8", [2 * MiB]), chunk(b"\1" * size)], C.INVALID_ARGUMENT)


@kind
def put_message_over_transport_limit(draw: Draw) -> Case:
    size = MiB + draw(st.integers(200 * 1024, 400 * 1024))
    return put(
        [header(draw(keys()), "uint8", [2 * MiB]), chunk(b"\1" * size)], C.RESOURCE_EXHAUSTED
    )


@kind
def put_conflicting_dtype(draw: Draw) -> Case:
    dtype = draw(st.sampled_from(["uint8", "int8", "bfloat16", "float32", "int64"]))
    return put([header(FIXED, dtype, [4, 4])], C.FAILED_PRECONDITION)


@kind
def put_conflicting_shape(draw: Draw) -> Case:
    shape = draw(st.sampled_from([[16], [2, 8], [8, 2], [1, 4, 4], [4, 4, 1]]))
    return put([header(FIXED, "float16", shape)], C.FAILED_PRECONDITION)


@kind
def put_unknown_session(draw: Draw) -> Case:
    key, dtype, shape, data = draw(payload())
    sid = draw(st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=40))
    md = (("x-embcache-session", sid),)
    return put([header(key, dtype, shape), chunk(data)], C.FAILED_PRECONDITION, metadata=md)


@kind
def get_unknown_session(draw: Draw) -> Case:
    md = (("x-embcache-session", "session:" + draw(st.text("0123456789abcdef", max_size=32))),)
    return unary("Get", pb.GetRequest(keys=[FIXED]), C.FAILED_PRECONDITION, metadata=md)


@kind
def get_device_without_pool(draw: Draw) -> Case:
    uuid = "GPU-" + draw(st.text("0123456789abcdef-", min_size=1, max_size=36))
    return unary("Get", pb.GetRequest(keys=[FIXED], gpu_uuid=uuid), C.FAILED_PRECONDITION)


@kind
def get_ttl_not_positive(draw: Draw) -> Case:
    ttl = draw(st.floats(max_value=0.0, allow_nan=False))
    return unary("Get", pb.GetRequest(keys=[FIXED], ttl_s=ttl), C.INVALID_ARGUMENT)


@kind
def get_ttl_nan(draw: Draw) -> Case:
    return unary("Get", pb.GetRequest(keys=[FIXED], ttl_s=math.nan), C.INVALID_ARGUMENT)


@kind
def get_garbage(draw: Draw) -> Case:
    return unary("Get", draw(GARBAGE), C.INVALID_ARGUMENT)


@kind
def get_key_invalid_utf8(draw: Draw) -> Case:
    return unary("Get", field(1, draw(BAD_UTF8)), C.INVALID_ARGUMENT)


@kind
def get_bytes_missing_key(draw: Draw) -> Case:
    req = pb.GetBytesRequest(key=draw(keys()))
    return Case("GetBytes", "server_stream", [req.SerializeToString()], C.NOT_FOUND)


@kind
def get_bytes_offset_past_end(draw: Draw) -> Case:
    req = pb.GetBytesRequest(key=FIXED, offset=draw(st.integers(33, 2**63)))
    return Case("GetBytes", "server_stream", [req.SerializeToString()], C.INVALID_ARGUMENT)


@kind
def get_bytes_length_past_end(draw: Draw) -> Case:
    offset = draw(st.integers(0, 32))
    req = pb.GetBytesRequest(key=FIXED, offset=offset, length=draw(st.integers(33 - offset, 2**40)))
    return Case("GetBytes", "server_stream", [req.SerializeToString()], C.INVALID_ARGUMENT)


@kind
def get_bytes_chunk_zero(draw: Draw) -> Case:
    req = pb.GetBytesRequest(key=FIXED, chunk_bytes=0)
    return Case("GetBytes", "server_stream", [req.SerializeToString()], C.INVALID_ARGUMENT)


@kind
def get_bytes_chunk_over_1mib(draw: Draw) -> Case:
    req = pb.GetBytesRequest(key=FIXED, chunk_bytes=draw(st.integers(MiB + 1, 2**32 - 1)))
    return Case("GetBytes", "server_stream", [req.SerializeToString()], C.INVALID_ARGUMENT)


@kind
def get_bytes_garbage(draw: Draw) -> Case:
    return Case("GetBytes", "server_stream", [draw(GARBAGE)], C.INVALID_ARGUMENT)


@kind
def evict_single_missing(draw: Draw) -> Case:
    return unary("Evict", pb.EvictRequest(keys=[draw(keys())]), C.NOT_FOUND)


@kind
def evict_single_leased(draw: Draw) -> Case:
    return unary("Evict", pb.EvictRequest(keys=[LEASED]), C.FAILED_PRECONDITION)


@kind
def evict_garbage(draw: Draw) -> Case:
    return unary("Evict", draw(GARBAGE), C.INVALID_ARGUMENT)


@kind
def renew_ttl_not_positive(draw: Draw) -> Case:
    ttl = draw(st.one_of(st.floats(max_value=0.0, allow_nan=False), st.just(math.nan)))
    return unary("Renew", pb.RenewRequest(lease_ids=[1], ttl_s=ttl), C.INVALID_ARGUMENT)


@kind
def release_garbage(draw: Draw) -> Case:
    return unary("Release", draw(GARBAGE), C.INVALID_ARGUMENT)


@kind
def exists_key_invalid_utf8(draw: Draw) -> Case:
    return unary("Exists", field(1, b"a") + field(1, draw(BAD_UTF8)), C.INVALID_ARGUMENT)


@kind
def stats_garbage(draw: Draw) -> Case:
    return unary("Stats", draw(GARBAGE), C.INVALID_ARGUMENT)


@kind
def put_from_device_in_cpu_mode(draw: Draw) -> Case:
    tensor = pb.CudaIpcTensor(
        gpu_uuid="GPU-x", ipc_handle=draw(st.binary(max_size=64)), dtype="float16", shape=[2]
    )
    return unary(
        "PutFromDevice",
        pb.PutFromDeviceRequest(key=draw(keys()), tensor=tensor),
        C.FAILED_PRECONDITION,
    )


@kind
def put_from_device_batch_in_cpu_mode(draw: Draw) -> Case:
    tensor = pb.CudaIpcTensor(
        gpu_uuid="GPU-x", ipc_handle=draw(st.binary(max_size=64)), dtype="float16", shape=[2]
    )
    items = [pb.PutFromDeviceRequest(key=draw(keys()), tensor=tensor)] * draw(st.integers(0, 2))
    return unary(
        "PutFromDeviceBatch", pb.PutFromDeviceBatchRequest(items=items), C.FAILED_PRECONDITION
    )


@kind
def get_into_in_cpu_mode(draw: Draw) -> Case:
    req = pb.GetIntoRequest(keys=[FIXED], offsets=[draw(st.integers(0, 2**40))])
    return unary("GetInto", req, C.FAILED_PRECONDITION)


@kind
def session_garbage_after_hello(draw: Draw) -> Case:
    hello = pb.SessionRequest(hello=pb.SessionHello(client_name="fuzz")).SerializeToString()
    return Case("Session", "bidi", [hello, draw(GARBAGE)], C.INVALID_ARGUMENT)


@kind
def unknown_method(draw: Draw) -> Case:
    name = draw(st.sampled_from(["Nope", "put", "GET", "Delete", "Stats2"]))
    return Case(name, "unary", [b""], C.UNIMPLEMENTED)


@kind
def unary_method_without_a_message(draw: Draw) -> Case:
    """A stream that ends before the request of a unary method: no wait until the deadline."""
    name = draw(st.sampled_from(["Get", "Exists", "Release", "Evict", "Stats", "GetInto"]))
    return Case(name, "client_stream", [], C.INVALID_ARGUMENT)


# -- running them ------------------------------------------------------------------------
def call(channel: grpc.Channel, case: Case) -> grpc.StatusCode:
    path = f"/embcache.v1.EmbeddingCache/{case.method}"
    raw = {"request_serializer": bytes, "response_deserializer": bytes}
    md, timeout = case.metadata, 10
    try:
        if case.kind == "unary":
            channel.unary_unary(path, **raw)(case.messages[0], metadata=md, timeout=timeout)
        elif case.kind == "client_stream":
            channel.stream_unary(path, **raw)(iter(case.messages), metadata=md, timeout=timeout)
        elif case.kind == "server_stream":
            list(channel.unary_stream(path, **raw)(case.messages[0], metadata=md, timeout=timeout))
        else:
            list(
                channel.stream_stream(path, **raw)(
                    iter(case.messages), metadata=md, timeout=timeout
                )
            )
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


@pytest.fixture(scope="module")
def fuzz_server() -> Iterator[tuple[CacheEngine, grpc.Channel]]:
    with tempfile.TemporaryDirectory(prefix="ecm-") as d:
        settings = Settings(
            grpc_port=0,
            grpc_socket=Path(d) / "m.sock",
            shm_name=f"embcache-test-fuzz-{time.time_ns()}",
            host_pool_bytes=POOL,
            page_bytes=64 * 1024,
            max_entry_bytes=MAX_ENTRY,
            max_key_bytes=MAX_KEY,
        )
        with serving(settings) as (engine, thread):
            assert thread.service is not None
            engine.put(FIXED, torch.zeros(4, 4, dtype=torch.float16))
            engine.put(LEASED, torch.zeros(8, dtype=torch.uint8))
            (lease,) = engine.get([LEASED], "fixture", ttl_s=3600)
            assert lease is not None
            with grpc.insecure_channel(f"unix:{thread.service.socket_path}") as channel:
                yield engine, channel
            engine.release([lease.lease_id])


def quiet(engine: CacheEngine, timeout: float = 5.0) -> bool:
    """No reservation left and only the fixture's lease (aborts may finish after the reply)."""
    deadline = time.monotonic() + timeout
    while True:
        s = engine.stats()
        if s.entries_filling == 0 and s.reserved_filling_bytes == 0 and s.leases_active == 1:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


def test_at_least_fifty_kinds() -> None:
    assert len(KINDS) >= 50, len(KINDS)


@pytest.mark.parametrize("name", sorted(KINDS))
@settings(
    max_examples=int(os.environ.get("EMBCACHE_FUZZ_EXAMPLES", "6")),
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
@given(data=st.data())
def test_malformed_request_gets_its_status(fuzz_server, name: str, data: st.DataObject) -> None:
    engine, channel = fuzz_server
    case = KINDS[name](data.draw)
    assert call(channel, case) == case.expected, case
    assert quiet(engine), engine.stats()


def test_server_survives_and_holds_nothing(fuzz_server) -> None:
    engine, channel = fuzz_server
    health = health_pb2_grpc.HealthStub(channel)
    assert (
        health.Check(health_pb2.HealthCheckRequest()).status
        == health_pb2.HealthCheckResponse.SERVING
    )
    stats = engine.stats()
    assert stats.entries_filling == 0 and stats.reserved_filling_bytes == 0
    assert stats.entries_ready == 2 and stats.leases_active == 1
    assert stats.host.used_pages == 2
