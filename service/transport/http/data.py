"""The REST data plane: put and read bytes, batch get with locations, release and renew.

Parity with gRPC, not a second implementation: puts go through ``engine.begin_put`` and
``PutHandle.write`` (same admission checks, collision guard and error table), bytes are read
with ``engine.get`` + ``engine.iter_bytes``, and ``POST /v1/get`` describes its leases with
``render.py``'s LocationRenderer, as gRPC does (a device get through the same flow,
``device_get.py``). Leases belong to ``rest:<client ip>`` and end by release or TTL (HTTP
has no session whose end could release them); release and renew accept that owner's lease
ids only. A get whose reply fails or is cancelled before it is handed to the server gives
its leases back. The in-flight quota of a put follows the token (every client of the one
shared token shares it), or the client address without one, as on gRPC over TCP.

Put bodies are streamed into the reserved pages chunk by chunk as they arrive; the body is
never held in memory whole. Any way out but a commit (bad bytes, a short body, the client
disconnecting, no bytes for ``put_idle_timeout_s``) aborts the handle: nothing becomes
visible and the pages are freed.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from starlette.requests import ClientDisconnect
from starlette.routing import Match
from starlette.types import Scope

from embcache.errors import InvalidArgument, NotFound
from embcache.proto import dtypes
from embcache.proto.constants import (
    CHECKSUM_HEADER,
    CHUNK_BYTES,
    DTYPE_HEADER,
    NBYTES_HEADER,
    SHAPE_HEADER,
)
from embcache.proto.locations import BatchDescription
from embcache.service.engine import CacheEngine
from embcache.service.host import admission
from embcache.service.transport import device_get
from embcache.service.transport.device_get import in_thread
from embcache.service.transport.http.bodies import JsonBodyRoute
from embcache.service.transport.http.data_models import (
    GetRequest,
    GetResponse,
    PutResponse,
    ReleaseRequest,
    ReleaseResponse,
    RenewRequest,
    RenewResponse,
    render_batch,
)
from embcache.service.transport.http.leased_stream import LeasedStream, entry_headers
from embcache.service.transport.http.models import ErrorBody
from embcache.service.transport.http.put_params import (
    SHAPE_PATTERN,
    one_of,
    parse_checksum,
    parse_shape,
)
from embcache.service.transport.http.ranges import RangeNotSatisfiable, parse_range
from embcache.service.transport.http.routes import BEARER, POSTED
from embcache.service.transport.idle import idle_limited
from embcache.service.transport.render import LocationRenderer
from embcache.service.transport.session.registry import REST_PREFIX, tcp_client

log = logging.getLogger(__name__)


ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (400, 401, 404, 409, 413, 422, 429, 503, 507)
}
router = APIRouter(
    prefix="/v1", responses=ERRORS, dependencies=[BEARER, POSTED], route_class=JsonBodyRoute
)


def rest_owner(request: Request) -> str:
    """Owner of the leases taken over REST: one per client address."""
    return REST_PREFIX + _address(request)


def quota_owner(request: Request) -> str:
    """Whose in-flight quota a REST put counts against: the token's, else the address's."""
    return tcp_client(_address(request), bool(_engine(request).settings.auth_token))


def _address(request: Request) -> str:
    return request.client.host if request.client else "unknown"


def _engine(request: Request) -> CacheEngine:
    engine: CacheEngine = request.app.state.engine
    return engine


# -- put -----------------------------------------------------------------------------------
def _content_length(request: Request) -> int | None:
    raw = request.headers.get("content-length")
    if raw is None:
        return None
    if not raw.isascii() or not raw.isdigit():  # the HTTP server rejects these first
        raise InvalidArgument("bad Content-Length", content_length=raw)
    return int(raw)


# Every dtype name a put accepts (the wire names and their aliases), for the schema.
_DTYPE: dict[str, Any] = {"enum": sorted(dtypes.names())}
# The shape as parse_shape reads it (not enforced by FastAPI: parse_shape answers 400).
_SHAPE: dict[str, Any] = {"pattern": SHAPE_PATTERN}
# A CRC32 as parse_checksum reads it: decimal up to 4294967295, or 0x and 1-8 hex digits.
_CRC32 = (
    r"^(0[xX][0-9a-fA-F]{1,8}|[0-9]{1,9}|[0-3][0-9]{9}|4[01][0-9]{8}|42[0-8][0-9]{7}"
    r"|429[0-3][0-9]{6}|4294[0-8][0-9]{5}|42949[0-5][0-9]{4}|429496[0-6][0-9]{3}"
    r"|4294967[01][0-9]{2}|42949672[0-8][0-9]|429496729[0-5])$"
)


class _NotOnData(APIRoute):
    """Any method but GET on a path ending in a real ``/data``: 405. The last ``/data`` of a
    path is the bytes suffix for every method; the key ``a/data`` is ``a%2Fdata``."""

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        raw = scope.get("raw_path")
        if not (isinstance(raw, bytes) and raw.endswith(b"/data")):
            return Match.NONE, {}
        if scope.get("method") in ("GET", "HEAD"):
            return Match.NONE, {}
        return super().matches(scope)


async def _data_method_not_allowed() -> JSONResponse:
    body = {
        "error": "MethodNotAllowed",
        "code": "INVALID_ARGUMENT",
        "message": "a path ending in /data is an entry's bytes: only GET; put or delete the "
        "key 'a/data' as /v1/entries/a%2Fdata",
        "details": {},
    }
    return JSONResponse(body, status_code=405, headers={"Allow": "GET"})


router.add_api_route(
    "/entries/{key:path}/data",
    _data_method_not_allowed,
    methods=["PUT", "POST", "DELETE", "PATCH", "OPTIONS"],
    route_class_override=_NotOnData,
    include_in_schema=False,
)

PUT_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "description": "The entry's bytes, row-major, exactly dtype size x prod(shape) of them. "
        "Streamed straight into the reserved pages. Content-Length, when sent, must equal "
        "that size; chunked bodies are counted.",
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    }
}


@router.put(
    "/entries/{key:path}",
    status_code=201,
    response_model=PutResponse,
    responses={200: {"model": PutResponse, "description": "An identical entry existed."}},
    openapi_extra=PUT_BODY,
    summary="Store an entry from a raw body",
)
async def put_entry(
    request: Request,
    key: str,
    x_dtype: Annotated[
        str | None,
        Header(alias=DTYPE_HEADER, description="dtype, e.g. bfloat16.", json_schema_extra=_DTYPE),
    ] = None,
    x_shape: Annotated[
        str | None,
        Header(
            alias=SHAPE_HEADER,
            description="Comma-separated dims: 3,4 (at most 8, each 0 or more).",
            json_schema_extra=_SHAPE,
        ),
    ] = None,
    x_checksum: Annotated[
        str | None,
        Header(
            alias=CHECKSUM_HEADER,
            description="CRC32 of the body (decimal or 0x hex).",
            json_schema_extra={"pattern": _CRC32},
        ),
    ] = None,
    dtype: Annotated[
        str | None, Query(description="Or X-Embcache-Dtype.", json_schema_extra=_DTYPE)
    ] = None,
    shape: Annotated[
        str | None,
        Query(max_length=256, description="Or X-Embcache-Shape.", json_schema_extra=_SHAPE),
    ] = None,
    checksum: Annotated[
        str | None, Query(pattern=_CRC32, description="Or X-Embcache-Checksum.")
    ] = None,
) -> JSONResponse:
    engine = _engine(request)
    dtype_s = one_of(x_dtype, dtype, "dtype")
    shape_s = one_of(x_shape, shape, "shape")
    crc_s = one_of(x_checksum, checksum, "checksum")
    if dtype_s is None or shape_s is None:
        raise InvalidArgument(
            f"a put needs dtype and shape ({DTYPE_HEADER} / {SHAPE_HEADER} or ?dtype=&shape=)"
        )
    dims = parse_shape(shape_s)
    crc = parse_checksum(crc_s) if crc_s is not None else None
    # Everything is checked before a page is reserved: size limits first (413 for a huge
    # declared entry), then the body length against the metadata.
    meta = admission.check_meta(dtype_s, dims, None, engine.settings)
    length = _content_length(request)
    if length is not None and length != meta.nbytes:
        raise InvalidArgument(
            "Content-Length does not match dtype and shape",
            content_length=length,
            nbytes=meta.nbytes,
        )
    handle = engine.begin_put(
        key, meta.dtype.name, dims, nbytes=meta.nbytes, checksum=crc, owner=quota_owner(request)
    )
    idle_s = engine.settings.put_idle_timeout_s
    with handle:  # any exit but commit aborts: nothing visible, pages freed
        try:
            async for chunk in idle_limited(request.stream(), idle_s):
                if chunk:
                    handle.write(chunk)
        except ClientDisconnect:
            log.info("PUT %r: client went away after %d bytes", key, handle.written)
            handle.abort()
            return _disconnected()
        created = handle.commit()
    body = PutResponse(
        key=key, created=created, dtype=meta.dtype.name, shape=list(dims), nbytes=meta.nbytes
    )
    return JSONResponse(body.model_dump(), status_code=201 if created else 200)


def _disconnected() -> JSONResponse:
    # Nobody reads this; it records the outcome (499, as in the error table's CANCELLED).
    body = {"error": "ClientDisconnect", "code": "CANCELLED", "message": "client went away"}
    return JSONResponse({**body, "details": {}}, status_code=499)


# -- get bytes -----------------------------------------------------------------------------
class _DataRoute(APIRoute):
    """``/entries/{key:path}/data`` only where the request spelled ``/data`` with a real
    slash: ``/v1/entries/a%2Fdata`` is the entry ``a/data`` itself (the detail route)."""

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        match, child = super().matches(scope)
        raw = scope.get("raw_path")
        if match is not Match.NONE and isinstance(raw, bytes) and not raw.endswith(b"/data"):
            return Match.NONE, {}
        return match, child


_ENTRY_HEADERS = {
    DTYPE_HEADER: {"schema": {"type": "string"}, "description": "dtype of the entry."},
    SHAPE_HEADER: {"schema": {"type": "string"}, "description": "Comma-separated dims."},
    NBYTES_HEADER: {"schema": {"type": "integer"}, "description": "Size of the whole entry."},
    CHECKSUM_HEADER: {
        "schema": {"type": "integer"},
        "description": "CRC32 of the whole entry, when its put declared one.",
    },
}
_BINARY = {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}


async def get_entry_data(
    request: Request,
    key: str,
    range_: Annotated[
        str | None,
        Header(alias="Range", description="One range: bytes=a-b, bytes=a- or bytes=-n."),
    ] = None,
) -> Response:
    engine = _engine(request)
    lease = engine.get([key], rest_owner(request))[0]
    if lease is None:
        raise NotFound("no such entry", key=key)
    try:
        span = parse_range(range_, lease.nbytes)
        headers = entry_headers(lease)
        start, stop, status = 0, lease.nbytes, 200
        if span is not None:
            start, stop, status = span[0], span[1], 206
            headers["Content-Range"] = f"bytes {start}-{stop - 1}/{lease.nbytes}"
        headers["Content-Length"] = str(stop - start)
        return LeasedStream(engine, lease, start, stop, status_code=status, headers=headers)
    except RangeNotSatisfiable as exc:
        engine.release([lease.lease_id])
        body = {
            "error": "RangeNotSatisfiable",
            "code": "INVALID_ARGUMENT",
            "message": str(exc),
            "details": {"range": range_, "nbytes": lease.nbytes},
        }
        return JSONResponse(
            body, status_code=416, headers={"Content-Range": f"bytes */{lease.nbytes}"}
        )
    except BaseException:
        engine.release([lease.lease_id])
        raise


router.add_api_route(
    "/entries/{key:path}/data",
    get_entry_data,
    methods=["GET"],
    route_class_override=_DataRoute,
    response_class=StreamingResponse,
    summary="Read an entry's bytes (streamed; Range supported)",
    description="Keys may contain '/': the last '/data' is the suffix. The entry 'a/data' "
    "itself is /v1/entries/a%2Fdata; its bytes are /v1/entries/a/data/data.",
    responses={
        200: {"content": _BINARY, "headers": _ENTRY_HEADERS, "description": "The bytes."},
        206: {"content": _BINARY, "headers": _ENTRY_HEADERS, "description": "One range."},
        416: {"model": ErrorBody, "description": "The range lies outside the entry."},
    },
)


# -- batch get / release / renew -----------------------------------------------------------
@router.post(
    "/get",
    response_model=GetResponse,
    response_model_exclude_none=True,
    summary="Lease entries and describe where they are",
)
async def get_batch(request: Request, body: GetRequest) -> Response:
    """Host locations (shared-memory byte runs) or, with ``gpu_uuid``, device locations plus
    the pool descriptions (IPC handles; only ever sent to authenticated callers)."""
    engine = _engine(request)
    renderer: LocationRenderer = request.app.state.renderer
    owner = rest_owner(request)
    ttl = body.ttl_s if body.ttl_s is not None else engine.settings.lease_ttl_s

    def reply(batch: BatchDescription) -> tuple[JSONResponse, list[int]]:
        """The whole response, rendered and encoded; its leases go back if that fails."""
        try:
            out = render_batch(batch, ttl).model_dump(mode="json", exclude_none=True)
            return JSONResponse(out), batch.lease_ids
        except BaseException:
            engine.release(batch.lease_ids, owner)
            raise

    if body.gpu_uuid is not None:  # the one device-get flow, as over gRPC
        keys = list(body.keys)
        index = engine.device.index_for(body.gpu_uuid)
        pool = engine.device.pool(index)
        batch, _ = await device_get.get_to_device(
            engine,
            keys,
            owner,
            index,
            ttl_s=body.ttl_s,
            render=lambda found: renderer.device_batch(keys, found, pool),
            housekeeping=request.app.state.housekeeping,
        )
        return reply(batch)[0]
    # A host get waits for nothing but the lock (and a shared-tier fill); it is rendered in
    # the worker thread too. Cancelled meanwhile: the leases it took go back when it ends.
    response, _ = await in_thread(
        lambda: reply(renderer.get_host(body.keys, owner, ttl_s=body.ttl_s)),
        undo=lambda done: engine.release(done[1], owner),
    )
    return response


@router.post("/release", response_model=ReleaseResponse, summary="End leases")
def release(request: Request, body: ReleaseRequest) -> ReleaseResponse:
    """End leases this client address holds (others' ids are skipped, as unknown ones)."""
    return ReleaseResponse(released=_engine(request).release(body.ids(), rest_owner(request)))


@router.post("/renew", response_model=RenewResponse, summary="Extend leases")
def renew(request: Request, body: RenewRequest) -> RenewResponse:
    """Extend leases this client address holds (others' ids are skipped)."""
    engine = _engine(request)
    return RenewResponse(renewed=engine.renew(body.ids(), body.ttl_s, rest_owner(request)))


__all__ = ["CHUNK_BYTES", "LeasedStream", "parse_checksum", "parse_shape", "rest_owner", "router"]
