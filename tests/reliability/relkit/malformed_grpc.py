"""Malformed gRPC input: named kinds, each a hypothesis-driven builder of raw request bytes
and the status the daemon must answer with.

Raw bytes go through a generic channel (identity serializers), so undecodable messages,
oversized messages and broken chunk sequences reach the daemon as they are.
"""

from __future__ import annotations

import itertools
import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from hypothesis import strategies as st

from embcache.proto.embcache.v1 import embcache_pb2 as pb

C = grpc.StatusCode
SERVICE = "/embcache.v1.EmbeddingCache/"
POOL = 16 << 20  # the daemon these kinds run against (see test_malformed.py)
MAX_KEY = 64
FIXED = "fixed-f16"  # float16 [4, 4], present
LEASED = "fixed-leased"  # uint8 [8], leased by the fixture
SIZES = {"uint8": 1, "int8": 1, "float16": 2, "bfloat16": 2, "float32": 4, "int64": 8}
Draw = Callable[[st.SearchStrategy[Any]], Any]

# method -> call shape
METHODS = {
    "Put": "client_stream",
    "PutFromDevice": "unary",
    "PutFromDeviceBatch": "unary",
    "Get": "unary",
    "GetInto": "unary",
    "GetBytes": "server_stream",
    "Release": "unary",
    "Renew": "unary",
    "Exists": "unary",
    "Evict": "unary",
    "Stats": "unary",
    "Session": "bidi",
}


@dataclass
class Case:
    method: str
    messages: list[bytes]
    expected: grpc.StatusCode
    metadata: tuple[tuple[str, str], ...] = ()

    @property
    def shape(self) -> str:
        return METHODS.get(self.method, "unary")


KINDS: dict[str, Callable[[Draw], Case]] = {}


def kind(name: str) -> Callable[[Callable[[Draw], Case]], Callable[[Draw], Case]]:
    def register(fn: Callable[[Draw], Case]) -> Callable[[Draw], Case]:
        assert name not in KINDS, name
        KINDS[name] = fn
        return fn

    return register


# -- wire building blocks ------------------------------------------------------------------
def varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def header(key: str, dtype: str, shape: list[int], nbytes: int | None = None, **kw: Any) -> bytes:
    h = pb.PutHeader(key=key, dtype=dtype, shape=shape, **kw)
    if nbytes is not None:
        h.nbytes = nbytes
    return pb.PutRequest(header=h).SerializeToString()


def chunk(data: bytes) -> bytes:
    return pb.PutRequest(chunk=data).SerializeToString()


def ascii_tokens() -> st.SearchStrategy[str]:
    """Printable ASCII: what gRPC metadata values may carry."""
    return st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=24)


def keys() -> st.SearchStrategy[str]:
    return st.text(st.characters(min_codepoint=33, max_codepoint=0x2FFF), min_size=1, max_size=20)


@st.composite
def metas(draw: Draw) -> tuple[str, str, list[int], bytes]:
    """A fresh key and a small valid (dtype, shape, payload)."""
    dtype = draw(st.sampled_from(sorted(SIZES)))
    shape = draw(st.lists(st.integers(1, 8), min_size=1, max_size=3))
    nbytes = math.prod(shape) * SIZES[dtype]
    data = draw(st.binary(min_size=nbytes, max_size=nbytes))
    return "m-" + draw(keys()), dtype, shape, data


def split(draw: Draw, data: bytes) -> list[bytes]:
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=3)))
    return [chunk(data[a:b]) for a, b in itertools.pairwise([0, *cuts, len(data)])]


# -- undecodable bytes, on every method -----------------------------------------------------
CORRUPT: dict[str, Callable[[Draw], bytes]] = {
    "truncated_length": lambda d: b"\x0a\x7f" + d(st.binary(max_size=20)),
    "truncated_varint": lambda d: b"\x08" + b"\xff" * d(st.integers(1, 9)),
    "wire_type_6": lambda d: b"\x0e" + d(st.binary(max_size=8)),
    "wire_type_7": lambda d: b"\x0f" + d(st.binary(max_size=8)),
    "unmatched_end_group": lambda d: d(st.sampled_from([b"\x0c", b"\x14", b"\x1c"])),
    "overlong_varint": lambda d: b"\x08" + b"\xff" * d(st.integers(10, 12)) + b"\x01",
}

# A message of each request type with one string field set to a marker, for bad UTF-8.
_MARK = "QQQQ"
_UTF8_TEMPLATES: dict[str, bytes] = {
    "Put": header(_MARK, "uint8", [1]),
    "PutFromDevice": pb.PutFromDeviceRequest(key=_MARK).SerializeToString(),
    "PutFromDeviceBatch": pb.PutFromDeviceBatchRequest(
        items=[pb.PutFromDeviceRequest(key="ok"), pb.PutFromDeviceRequest(key=_MARK)]
    ).SerializeToString(),
    "Get": pb.GetRequest(keys=[_MARK]).SerializeToString(),
    "GetInto": pb.GetIntoRequest(keys=[_MARK]).SerializeToString(),
    "GetBytes": pb.GetBytesRequest(key=_MARK).SerializeToString(),
    "Exists": pb.ExistsRequest(keys=[_MARK]).SerializeToString(),
    "Evict": pb.EvictRequest(keys=[_MARK]).SerializeToString(),
    "Session": pb.SessionRequest(hello=pb.SessionHello(client_name=_MARK)).SerializeToString(),
}
BAD_UTF8 = [b"\xff\xfe\xfd\xfc", b"\xc3\x28ab", b"\xed\xa0\x80a", b"ab\xe2\x82"]


def _register_raw() -> None:
    for method in METHODS:
        for name, build in CORRUPT.items():

            def undecodable(
                draw: Draw, m: str = method, b: Callable[[Draw], bytes] = build
            ) -> Case:
                return Case(m, [b(draw)], C.INVALID_ARGUMENT)

            kind(f"grpc/{method}/undecodable_{name}")(undecodable)

        def oversized(draw: Draw, m: str = method) -> Case:
            n = (1 << 20) + 128 * 1024 + draw(st.integers(1, 4096))
            return Case(m, [b"\x0a" + varint(n) + b"a" * n], C.RESOURCE_EXHAUSTED)

        kind(f"grpc/{method}/message_over_limit")(oversized)
        if method in _UTF8_TEMPLATES:

            def bad_utf8(draw: Draw, m: str = method) -> Case:
                raw = _UTF8_TEMPLATES[m].replace(_MARK.encode(), draw(st.sampled_from(BAD_UTF8)))
                return Case(m, [raw], C.INVALID_ARGUMENT)

            kind(f"grpc/{method}/string_not_utf8")(bad_utf8)
    for name, build in CORRUPT.items():

        def after_header(draw: Draw, b: Callable[[Draw], bytes] = build) -> Case:
            key, dtype, shape, _ = draw(metas())
            return Case("Put", [header(key, dtype, shape), b(draw)], C.INVALID_ARGUMENT)

        kind(f"grpc/Put/undecodable_after_header_{name}")(after_header)


_register_raw()


# -- Put: headers, sizes, chunk sequences ---------------------------------------------------
def put(messages: list[bytes], expected: grpc.StatusCode = C.INVALID_ARGUMENT, **kw: Any) -> Case:
    return Case("Put", messages, expected, **kw)


@kind("grpc/Put/empty_stream")
def _(draw: Draw) -> Case:
    return put([])


@kind("grpc/Put/chunk_before_header")
def _(draw: Draw) -> Case:
    return put([chunk(draw(st.binary(max_size=64)))])


@kind("grpc/Put/empty_message_first")
def _(draw: Draw) -> Case:
    return put([b"", *[chunk(b"x")] * draw(st.integers(0, 2))])


@kind("grpc/Put/empty_message_after_header")
def _(draw: Draw) -> Case:
    key, dtype, shape, data = draw(metas())
    return put([header(key, dtype, shape), b"", chunk(data)])


@kind("grpc/Put/second_header")
def _(draw: Draw) -> Case:
    key, dtype, shape, data = draw(metas())
    return put([header(key, dtype, shape), header(key, dtype, shape), chunk(data)])


@kind("grpc/Put/header_only")
def _(draw: Draw) -> Case:
    key, dtype, shape, _ = draw(metas())
    return put([header(key, dtype, shape)])


@kind("grpc/Put/too_few_bytes")
def _(draw: Draw) -> Case:
    key, dtype, shape, data = draw(metas())
    cut = draw(st.integers(0, len(data) - 1))
    return put([header(key, dtype, shape), *split(draw, data[:cut])])


@kind("grpc/Put/too_many_bytes")
def _(draw: Draw) -> Case:
    key, dtype, shape, data = draw(metas())
    extra = draw(st.binary(min_size=1, max_size=64))
    return put([header(key, dtype, shape), *split(draw, data + extra)])


@kind("grpc/Put/bad_checksum")
def _(draw: Draw) -> Case:
    key, dtype, shape, data = draw(metas())
    crc = zlib.crc32(data) ^ draw(st.integers(1, 2**32 - 1))
    return put([header(key, dtype, shape, checksum=crc), *split(draw, data)])


@kind("grpc/Put/chunk_over_1MiB")
def _(draw: Draw) -> Case:
    n = (1 << 20) + draw(st.integers(1, 1024))
    return put([header("m-big-chunk", "uint8", [n]), chunk(b"\0" * n)])


@kind("grpc/Put/key_empty")
def _(draw: Draw) -> Case:
    return put([header("", "uint8", [1]), chunk(b"x")])


@kind("grpc/Put/key_too_long")
def _(draw: Draw) -> Case:
    key = "k" * draw(st.integers(MAX_KEY + 1, 4 * MAX_KEY))
    return put([header(key, "uint8", [1]), chunk(b"x")])


@kind("grpc/Put/key_multibyte_too_long")
def _(draw: Draw) -> Case:
    key = "é" * (MAX_KEY // 2 + draw(st.integers(1, 8)))  # few chars, too many bytes
    return put([header(key, "uint8", [1]), chunk(b"x")])


@kind("grpc/Put/key_with_nul")
def _(draw: Draw) -> Case:
    key = draw(keys()) + "\x00" + draw(keys())
    return put([header(key[:MAX_KEY], "uint8", [1]), chunk(b"x")])


DTYPE_BAD = {
    "dtype_unknown": ["complex64", "float128", "int128", "str", "object", "qint8", "uint4"],
    "dtype_empty": [""],
    "dtype_wrong_case": ["Float32", "FLOAT16", "BFloat16", "UINT8"],
    "dtype_padded": [" float16", "float16 ", "float16\x00", "\tuint8"],
    "dtype_torch_prefixed": ["torch.float16", "torch.bfloat16", "np.float32"],
    "dtype_numeric": ["0", "16", "-1", "2.5"],
}
for _name, _values in DTYPE_BAD.items():

    def _bad_dtype(draw: Draw, values: list[str] = _values) -> Case:
        return put([header("m-dtype", draw(st.sampled_from(values)), [1]), chunk(b"xxxxxxxx")])

    kind(f"grpc/Put/{_name}")(_bad_dtype)


@kind("grpc/Put/shape_negative")
def _(draw: Draw) -> Case:
    shape = draw(st.lists(st.integers(1, 4), min_size=0, max_size=3))
    shape.insert(draw(st.integers(0, len(shape))), draw(st.integers(-(2**63), -1)))
    return put([header("m-neg", "uint8", shape)])


@kind("grpc/Put/shape_too_many_dims")
def _(draw: Draw) -> Case:
    return put([header("m-dims", "uint8", [1] * draw(st.integers(9, 64))), chunk(b"x")])


@kind("grpc/Put/shape_overflows_int64")
def _(draw: Draw) -> Case:
    shape = [2**40, 2**30] if draw(st.booleans()) else [2**62, draw(st.integers(2, 8))]
    return put([header("m-ovf", draw(st.sampled_from(sorted(SIZES))), shape)])


@kind("grpc/Put/nbytes_too_small")
def _(draw: Draw) -> Case:
    key, dtype, shape, data = draw(metas())
    return put([header(key, dtype, shape, draw(st.integers(0, len(data) - 1))), chunk(data)])


@kind("grpc/Put/nbytes_too_large")
def _(draw: Draw) -> Case:
    key, dtype, shape, data = draw(metas())
    nbytes = draw(st.integers(len(data) + 1, 2**64 - 1))
    return put([header(key, dtype, shape, nbytes), chunk(data)])


@kind("grpc/Put/entry_larger_than_pool")
def _(draw: Draw) -> Case:
    n = POOL + draw(st.integers(1, 2**40))
    return put([header("m-huge", "uint8", [n])], C.RESOURCE_EXHAUSTED)


@kind("grpc/Put/metadata_conflict")
def _(draw: Draw) -> Case:
    shape = draw(st.sampled_from([[16], [2, 8], [4, 4, 1], [8, 2]]))
    dtype = draw(st.sampled_from(["float16", "bfloat16", "int16"]))
    if dtype == "float16" and shape == [4, 4]:
        shape = [16]
    return put([header(FIXED, dtype, shape), chunk(b"\0" * 32)], C.FAILED_PRECONDITION)


@kind("grpc/Put/existing_key_too_many_bytes")
def _(draw: Draw) -> Case:
    return put([header(FIXED, "float16", [4, 4]), chunk(b"\0" * draw(st.integers(33, 200)))])


@kind("grpc/Put/existing_key_bad_checksum")
def _(draw: Draw) -> Case:
    data = draw(st.binary(min_size=32, max_size=32))
    crc = zlib.crc32(data) ^ 1
    return put([header(FIXED, "float16", [4, 4], checksum=crc), chunk(data)])


@kind("grpc/Put/unknown_session")
def _(draw: Draw) -> Case:
    key, dtype, shape, data = draw(metas())
    session = "session:" + draw(st.text("0123456789abcdef", min_size=1, max_size=32))
    return put(
        [header(key, dtype, shape), chunk(data)],
        C.FAILED_PRECONDITION,
        metadata=(("x-embcache-session", session),),
    )


# -- Get, GetBytes, Renew, Evict ----------------------------------------------------------
BAD_TTL = {
    "negative": st.floats(max_value=-1e-9, allow_nan=False),
    "zero": st.just(0.0),
    "nan": st.just(math.nan),
    "infinite": st.sampled_from([math.inf, -math.inf]),
    "over_max": st.floats(min_value=3600.001, max_value=1e300),
}
for _name, _strategy in BAD_TTL.items():

    def _get_ttl(draw: Draw, s: st.SearchStrategy[float] = _strategy) -> Case:
        msg = pb.GetRequest(keys=[FIXED], ttl_s=draw(s))
        return Case("Get", [msg.SerializeToString()], C.INVALID_ARGUMENT)

    def _renew_ttl(draw: Draw, s: st.SearchStrategy[float] = _strategy) -> Case:
        msg = pb.RenewRequest(lease_ids=[draw(st.integers(1, 2**63))], ttl_s=draw(s))
        return Case("Renew", [msg.SerializeToString()], C.INVALID_ARGUMENT)

    kind(f"grpc/Get/ttl_{_name}")(_get_ttl)
    kind(f"grpc/Renew/ttl_{_name}")(_renew_ttl)


@kind("grpc/Get/unknown_gpu")
def _(draw: Draw) -> Case:
    msg = pb.GetRequest(keys=[FIXED], gpu_uuid="GPU-" + draw(keys()))
    return Case("Get", [msg.SerializeToString()], C.FAILED_PRECONDITION)


@kind("grpc/Get/unknown_session")
def _(draw: Draw) -> Case:
    session = draw(st.sampled_from(["session:", "session:00", "anon:x", "x"])) + draw(
        ascii_tokens()
    )
    msg = pb.GetRequest(keys=[FIXED])
    md = (("x-embcache-session", session),)
    return Case("Get", [msg.SerializeToString()], C.FAILED_PRECONDITION, md)


@kind("grpc/GetBytes/missing_key")
def _(draw: Draw) -> Case:
    msg = pb.GetBytesRequest(key="absent-" + draw(keys()))
    return Case("GetBytes", [msg.SerializeToString()], C.NOT_FOUND)


@kind("grpc/GetBytes/offset_past_end")
def _(draw: Draw) -> Case:
    msg = pb.GetBytesRequest(key=FIXED, offset=draw(st.integers(33, 2**64 - 1)))
    return Case("GetBytes", [msg.SerializeToString()], C.INVALID_ARGUMENT)


@kind("grpc/GetBytes/length_past_end")
def _(draw: Draw) -> Case:
    offset = draw(st.integers(0, 32))
    msg = pb.GetBytesRequest(
        key=FIXED, offset=offset, length=draw(st.integers(33 - offset, 2**64 - 1))
    )
    return Case("GetBytes", [msg.SerializeToString()], C.INVALID_ARGUMENT)


@kind("grpc/GetBytes/chunk_bytes_zero")
def _(draw: Draw) -> Case:
    msg = pb.GetBytesRequest(key=FIXED, chunk_bytes=0)
    return Case("GetBytes", [msg.SerializeToString()], C.INVALID_ARGUMENT)


@kind("grpc/GetBytes/chunk_bytes_over_1MiB")
def _(draw: Draw) -> Case:
    msg = pb.GetBytesRequest(key=FIXED, chunk_bytes=draw(st.integers((1 << 20) + 1, 2**32 - 1)))
    return Case("GetBytes", [msg.SerializeToString()], C.INVALID_ARGUMENT)


@kind("grpc/GetBytes/unknown_session")
def _(draw: Draw) -> Case:
    msg = pb.GetBytesRequest(key=FIXED)
    md = (("x-embcache-session", "session:" + draw(ascii_tokens())),)
    return Case("GetBytes", [msg.SerializeToString()], C.FAILED_PRECONDITION, md)


@kind("grpc/Evict/single_missing_key")
def _(draw: Draw) -> Case:
    msg = pb.EvictRequest(keys=["absent-" + draw(keys())])
    return Case("Evict", [msg.SerializeToString()], C.NOT_FOUND)


@kind("grpc/Evict/single_leased_key")
def _(draw: Draw) -> Case:
    return Case(
        "Evict", [pb.EvictRequest(keys=[LEASED]).SerializeToString()], C.FAILED_PRECONDITION
    )


# -- device RPCs on a daemon without CUDA, routing -----------------------------------------
def _ipc_tensor(draw: Draw) -> pb.CudaIpcTensor:
    """A well-formed description of 8 bytes on a GPU this daemon does not have."""
    handle = draw(st.binary(min_size=64, max_size=64))
    return pb.CudaIpcTensor(
        gpu_uuid="GPU-x", ipc_handle=handle, dtype="uint8", shape=[8], alloc_size=8
    )


@kind("grpc/PutFromDevice/on_cpu_daemon")
def _(draw: Draw) -> Case:
    msg = pb.PutFromDeviceRequest(key="m-" + draw(keys()), tensor=_ipc_tensor(draw))
    return Case("PutFromDevice", [msg.SerializeToString()], C.FAILED_PRECONDITION)


@kind("grpc/PutFromDeviceBatch/on_cpu_daemon")
def _(draw: Draw) -> Case:
    items = [
        pb.PutFromDeviceRequest(key=f"m-{i}-" + draw(keys()), tensor=_ipc_tensor(draw))
        for i in range(draw(st.integers(0, 3)))
    ]
    msg = pb.PutFromDeviceBatchRequest(items=items)
    return Case("PutFromDeviceBatch", [msg.SerializeToString()], C.FAILED_PRECONDITION)


@kind("grpc/GetInto/on_cpu_daemon")
def _(draw: Draw) -> Case:
    t = pb.CudaIpcTensor(
        gpu_uuid="GPU-x",
        ipc_handle=draw(st.binary(min_size=64, max_size=64)),
        dtype="uint8",
        shape=[64],
        alloc_size=64,
    )
    msg = pb.GetIntoRequest(keys=[FIXED], destination=pb.DeviceBuffer(buffer=t))
    return Case("GetInto", [msg.SerializeToString()], C.FAILED_PRECONDITION)


@kind("grpc/unknown_method")
def _(draw: Draw) -> Case:
    name = draw(
        st.text("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz", min_size=1, max_size=12)
    )
    if name in METHODS:
        name += "X"
    return Case(name, [draw(st.binary(max_size=16))], C.UNIMPLEMENTED)


@kind("grpc/unknown_service")
def _(draw: Draw) -> Case:
    return Case("/embcache.v2.Nope/Stats", [b""], C.UNIMPLEMENTED)


# -- calling ------------------------------------------------------------------------------
def call(channel: grpc.Channel, case: Case, timeout: float = 10.0) -> grpc.StatusCode:
    """Send ``case`` as raw bytes; the status it ended with."""
    path = case.method if case.method.startswith("/") else SERVICE + case.method
    md = case.metadata
    try:
        if case.shape == "client_stream":
            channel.stream_unary(path)(iter(case.messages), timeout=timeout, metadata=md)
        elif case.shape == "server_stream":
            for _ in channel.unary_stream(path)(case.messages[0], timeout=timeout, metadata=md):
                pass
        elif case.shape == "bidi":
            for _ in channel.stream_stream(path)(iter(case.messages), timeout=timeout, metadata=md):
                pass
        else:
            channel.unary_unary(path)(case.messages[0], timeout=timeout, metadata=md)
    except grpc.RpcError as err:
        return err.code()
    return C.OK
