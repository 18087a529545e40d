"""Liveness, readiness and the Prometheus scrape endpoint."""

from __future__ import annotations

from typing import Any

import torch
from fastapi import APIRouter, Request, Response, Security
from fastapi.responses import JSONResponse
from fastapi.security import HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from embcache.service.engine import CacheEngine
from embcache.service.transport.http.models import ErrorBody, Liveness, Readiness

router = APIRouter(tags=["health"])


def readiness(engine: CacheEngine) -> Readiness:
    """Ready = host pool allocated (and registered with CUDA where CUDA is used), not draining."""
    pool_allocated = not engine.closed
    cuda_ready: bool | None = None
    if engine.settings.device != "cpu" and torch.cuda.is_available():
        cuda_ready = engine.host_segment().registered if pool_allocated else False
    draining = engine.draining
    ok = engine.ready and pool_allocated and cuda_ready is not False and not draining
    failed = [p.index for p in engine.device.pools if p.failed]
    return Readiness(
        status="ready" if ok else "not_ready",
        pool_allocated=pool_allocated,
        cuda_ready=cuda_ready,
        draining=draining,
        devices_out_of_service=failed,
    )


@router.head("/livez", operation_id="head_livez", summary="The process answers (no body)")
@router.get("/livez", response_model=Liveness, summary="The process answers")
async def livez() -> Liveness:
    return Liveness(status="ok")


@router.head("/readyz", operation_id="head_readyz", summary="Ready (status only, no body)")
@router.get(
    "/readyz",
    response_model=Readiness,
    responses={503: {"model": Readiness, "description": "Not ready (starting or draining)."}},
    summary="Ready to serve puts and gets",
)
def readyz(request: Request) -> Any:
    state = readiness(request.app.state.engine)
    if state.status != "ready":
        return JSONResponse(state.model_dump(), status_code=503)
    return state


@router.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text."},
        401: {"model": ErrorBody, "description": "A token is set and was not given."},
    },
    summary="Prometheus metrics",
    dependencies=[Security(HTTPBearer(auto_error=False))],
)
def metrics(request: Request) -> Response:
    registry = request.app.state.metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
