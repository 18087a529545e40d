"""The FastAPI app of the operator plane: REST API, health, metrics and the pool-map page.

``create_app(engine, settings, metrics)`` builds everything; nothing happens at import
time. Resources live on ``app.state`` and routes reach them through ``request.app.state``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from embcache import build_info
from embcache.errors import EmbCacheError
from embcache.service.config import Settings
from embcache.service.observability.metrics import RPC_BUCKETS, Metrics
from embcache.service.transport.device_get import Housekeeping
from embcache.service.transport.http import data as http_data
from embcache.service.transport.http import docs as http_docs
from embcache.service.transport.http import health as http_health
from embcache.service.transport.http import prefetch as http_prefetch
from embcache.service.transport.http import routes as http_routes
from embcache.service.transport.http import sessions as http_sessions
from embcache.service.transport.http.hosts import HostPolicy
from embcache.service.transport.http.middleware import OperatorMiddleware
from embcache.service.transport.http.poolmap import Counters, History
from embcache.service.transport.render import LocationRenderer
from embcache.service.transport.session.admin import SessionAdmin
from embcache.service.transport.session.registry import SessionRegistry
from embcache.service.transport.status import HTTP_CODE_NAMES, error_body, status_for

log = logging.getLogger(__name__)


def _static_dir() -> str:
    return str(resources.files("embcache.service.transport.http") / "static")


def error_response(
    status: int, error: str, code: str, message: str, details: dict[str, Any] | None = None
) -> JSONResponse:
    """An error in REST's one body shape: error type, gRPC code name, message, details."""
    body = {"error": error, "code": code, "message": message, "details": details or {}}
    return JSONResponse(body, status_code=status)


async def _on_engine_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, EmbCacheError)
    status = status_for(exc).http_status
    log.info(
        "%s %s -> %d %s: %s",
        request.method,
        request.url.path,
        status,
        type(exc).__name__,
        exc.message,
    )
    return JSONResponse(error_body(exc), status_code=status)


async def _on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    # Keep location, message and type; inputs can be large and contexts hold exceptions.
    errors: list[dict[str, Any]] = [
        {
            "loc": [str(p) for p in e.get("loc", ())],
            "msg": str(e.get("msg", "")),
            "type": str(e.get("type", "")),
        }
        for e in exc.errors()
    ]
    first = str(errors[0]["msg"]) if errors else "invalid request"
    return error_response(422, "ValidationError", "INVALID_ARGUMENT", first, {"errors": errors})


async def _on_http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    response = error_response(
        exc.status_code,
        "HTTPError",
        HTTP_CODE_NAMES.get(exc.status_code, "INTERNAL"),
        f"{exc.detail}",
    )
    if exc.headers:
        response.headers.update(exc.headers)
    if exc.status_code == 405 and (allowed := http_docs.allowed_methods(request)):
        response.headers["Allow"] = allowed  # Starlette names the first route's methods only
    return response


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error in %s %s", request.method, request.url.path)
    return error_response(500, "InternalError", "INTERNAL", "internal error")


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    history: History = app.state.history

    async def sample_forever() -> None:
        while True:
            try:  # off the loop: stats() takes the engine lock, which gRPC calls share
                await asyncio.to_thread(history.sample)
            except Exception:  # a failed sample must not end the history
                log.exception("pool-map sample failed")
            await asyncio.sleep(history.interval_s)

    task = asyncio.create_task(sample_forever(), name="embcache-poolmap-sampler")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def create_app(
    engine: Any, settings: Settings, metrics: Metrics, sessions: SessionAdmin | None = None
) -> FastAPI:
    """Build the operator-plane app for one engine. Auth applies when a token is set.
    ``sessions``: the data plane's (``servicer.admin``); None: an app without one."""
    app = FastAPI(
        title="embcache",
        summary="Operator and data API of the embcache embedding-cache daemon.",
        description="Routes under `/v1` are version 1 of the API; `info.version` is the "
        "daemon's package version (also in `GET /v1/stats`).",
        version=build_info.version(),
        lifespan=_lifespan,
        docs_url=None,  # docs.py serves /docs from the package, not from a CDN
        redoc_url=None,
        # An API answers a path it does not serve with its error shape (404), not with an
        # empty 307 to the path without its trailing slash (``DELETE /v1/sessions/``).
        redirect_slashes=False,
    )
    app.state.engine = engine
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.renderer = LocationRenderer(engine, settings)
    app.state.housekeeping = Housekeeping(engine)
    app.state.sessions = (
        sessions if sessions is not None else SessionAdmin(SessionRegistry(), engine)
    )

    def read_counters() -> Counters:
        stats = engine.stats()
        return Counters(
            hits=stats.hits,
            misses=stats.misses,
            copied=metrics.copied_bytes(stats),
            host_in=stats.put_bytes,
            host_out=getattr(stats, "hit_bytes", 0),
            operations=metrics.operation_buckets(),
        )

    app.state.history = History(read_counters, latency_bounds_s=RPC_BUCKETS)

    app.add_exception_handler(EmbCacheError, _on_engine_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)

    app.include_router(http_health.router)
    # Before the operator routes: GET /v1/entries/{key:path}/data must be tried before
    # GET /v1/entries/{key:path}, which would also match it.
    app.include_router(http_data.router)
    app.include_router(http_prefetch.router)
    app.include_router(http_routes.router)
    app.include_router(http_sessions.router)
    http_docs.mount_docs(app)
    http_docs.bound_schema(app, settings)

    static = _static_dir()

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(f"{static}/index.html", headers={"Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=static), name="static")
    hosts = HostPolicy(settings)
    log.debug("HTTP answers Host %s with its port, and its arrival address", hosts.names())
    app.add_middleware(OperatorMiddleware, metrics=metrics, token=settings.auth_token, hosts=hosts)
    return app
