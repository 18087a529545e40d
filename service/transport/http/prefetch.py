"""``POST /v1/prefetch``: warm the local tiers (shared tier -> host pool, and a GPU)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from embcache.service.transport.http.bodies import JsonBodyRoute
from embcache.service.transport.http.data_models import MAX_BATCH
from embcache.service.transport.http.routes import BEARER, ERRORS


class PrefetchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    keys: list[str] = Field(min_length=1, max_length=MAX_BATCH)
    gpu_uuid: str | None = Field(
        default=None, max_length=128, description="Also make the entries resident on this GPU."
    )


class PrefetchResponse(BaseModel):
    requested: int = Field(description="Distinct keys asked for.")
    local: int = Field(description="Already in the host pool.")
    fetched: int = Field(description="Filled from the shared tier.")
    missing: int = Field(description="Found nowhere (or the shared tier is unreachable).")
    resident: int = Field(description="Made resident on the GPU.")


router = APIRouter(prefix="/v1", responses=ERRORS, dependencies=[BEARER], route_class=JsonBodyRoute)


@router.post("/prefetch", response_model=PrefetchResponse, summary="Warm the local tiers")
def prefetch(request: Request, body: PrefetchRequest) -> PrefetchResponse:
    """Fetch keys missing here from the shared tier (when one is configured) and, with
    ``gpu_uuid``, make them resident on that GPU. Takes no leases; same as gRPC Prefetch."""
    engine = request.app.state.engine
    device = None
    if body.gpu_uuid is not None:
        device = engine.device.index_for(body.gpu_uuid)
    return PrefetchResponse(**engine.prefetch(body.keys, device=device))
