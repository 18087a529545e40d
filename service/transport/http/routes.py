"""The ``/v1`` operator routes: stats, entries, eviction and the pool map.

Handlers are plain ``def`` so FastAPI runs them in its thread pool: engine calls take the
engine lock and must not stall the event loop that also serves gRPC.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Security
from fastapi.security import HTTPBearer

from embcache import build_info
from embcache.errors import NotFound
from embcache.service.engine import EvictOutcome
from embcache.service.engine.stats import EntryInfo
from embcache.service.transport.http.bodies import JsonBodyRoute
from embcache.service.transport.http.health import readiness
from embcache.service.transport.http.models import (
    DeleteResponse,
    EntryDetail,
    EntryPage,
    EntrySort,
    EntryStateFilter,
    EntrySummary,
    ErrorBody,
    EvictBytes,
    EvictRequest,
    EvictResponse,
    LeaseHolder,
    PageRun,
    PoolMapHistory,
    PoolMapResponse,
    PoolMapSummary,
    PoolMapTier,
    StatsResponse,
    TierName,
)
from embcache.service.transport.http.poolmap import DEVICE_STATES, HOST_STATES, History, downsample
from embcache.service.transport.http.records import values_of

ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (400, 401, 404, 409, 413, 422, 503)
}
# The token itself is checked by the middleware (before routing); this dependency only
# declares the scheme in OpenAPI so /docs offers an "Authorize" button.
BEARER = Security(HTTPBearer(auto_error=False, description="Needed when the daemon has a token."))


async def posted_applied(request: Request) -> None:
    """Wait (bounded) until the stash commits that same-node clients posted before this
    request are applied, as the data plane's reads do (``session/posted.py``): an entry
    whose put returned is never missing here."""
    settle = getattr(request.app.state, "settle", None)
    if settle is not None:
        await settle(None)


POSTED = Depends(posted_applied)
router = APIRouter(
    prefix="/v1", responses=ERRORS, dependencies=[BEARER, POSTED], route_class=JsonBodyRoute
)


def _engine(request: Request) -> Any:
    return request.app.state.engine


def _summary(info: EntryInfo) -> dict[str, Any]:
    """The listing's fields of an entry: its record's, less the runs and lease holders
    (the detail writes them its own way), with the page counts."""
    values = values_of(info, idle_s=round(info.idle_s, 3))
    del values["page_runs"], values["lease_holders"]
    values["num_pages"] = sum(n for _, n in info.page_runs)
    values["num_runs"] = len(info.page_runs)
    return values


@router.get("/stats", response_model=StatsResponse, summary="Engine statistics")
def get_stats(request: Request) -> dict[str, Any]:
    endpoints = getattr(request.app.state, "endpoints", {})  # the daemon sets its listeners
    return {**build_info.as_dict(), **endpoints, **_engine(request).stats().to_dict()}


@router.get("/entries", response_model=EntryPage, summary="List entries (paged)")
def list_entries(
    request: Request,
    offset: Annotated[int, Query(ge=0, le=2**62)] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    state: EntryStateFilter | None = None,
    tier: TierName | None = None,
    sort: Annotated[
        EntrySort,
        Query(
            description="none: engine order; size: largest first; "
            "recent: most recently used first; idle: least recently used first"
        ),
    ] = "none",
) -> EntryPage:
    # The engine filters and sorts holding its lock a slice at a time (engine/listing.py),
    # so a listing of many entries never stalls the data plane.
    total, infos = _engine(request).list_entries(offset, limit, state, tier=tier, sort=sort)
    return EntryPage(
        total=total,
        offset=offset,
        limit=limit,
        items=[EntrySummary(**_summary(i)) for i in infos],
    )


@router.get("/entries/{key:path}", response_model=EntryDetail, summary="One entry in detail")
def get_entry(request: Request, key: str) -> EntryDetail:
    engine = _engine(request)
    info = engine.entry_info(key)
    if info is None:
        raise NotFound("no such entry", key=key)
    page_bytes = engine.settings.page_bytes
    runs, left = [], info.nbytes
    for first, n in info.page_runs:
        length = min(left, n * page_bytes)
        runs.append(
            PageRun(
                first_page=first, num_pages=n, byte_offset=first * page_bytes, byte_length=length
            )
        )
        left -= length
    holders = [
        LeaseHolder(owner=owner, expires_in_s=round(left, 3))
        for owner, left in getattr(info, "lease_holders", ())
    ]
    return EntryDetail(**_summary(info), page_runs=runs, lease_holders=holders)


@router.delete("/entries/{key:path}", response_model=DeleteResponse, summary="Evict one entry")
def delete_entry(request: Request, key: str) -> DeleteResponse:
    freed = _engine(request).evict_one(key)  # NotFound -> 404, EntryLeased -> 409
    return DeleteResponse(key=key, evicted=True, freed_bytes=freed)


@router.post(
    "/evict",
    response_model=EvictResponse,
    summary="Evict keys, or free bytes by LRU (from one device pool with 'device')",
)
def evict(request: Request, body: EvictRequest) -> EvictResponse:
    engine = _engine(request)
    if isinstance(body, EvictBytes):
        if body.device is None:
            count, freed = engine.evict_bytes(body.nbytes())
        else:  # DeviceUnavailable -> 409 when there is no such pool
            count, freed = engine.device.evict_bytes(body.device, body.nbytes())
        return EvictResponse(
            evicted=[], not_found=[], leased=[], freed_entries=count, freed_bytes=freed
        )
    keys = list(dict.fromkeys(body.keys))  # a key named twice is evicted once
    out: dict[EvictOutcome, list[str]] = {o: [] for o in EvictOutcome}
    device = body.device
    outcomes = engine.evict(keys) if device is None else engine.device.evict(keys, device)
    for key, outcome in zip(keys, outcomes, strict=True):
        out[outcome].append(key)
    evicted = out[EvictOutcome.EVICTED]
    return EvictResponse(
        evicted=evicted,
        not_found=out[EvictOutcome.NOT_FOUND],
        leased=out[EvictOutcome.LEASED],
        freed_entries=len(evicted),
        freed_bytes=outcomes.freed_bytes,
    )


@router.get("/pool-map", response_model=PoolMapResponse, summary="Data for the pool-map page")
def pool_map(
    request: Request,
    max_cells: Annotated[int, Query(ge=16, le=16384)] = 4096,
    device: Annotated[int, Query(ge=0, description="Device pool to draw (index)")] = 0,
) -> PoolMapResponse:
    state = request.app.state
    engine = state.engine
    history: History = state.history
    history.maybe_sample()
    stats = engine.stats()
    host = downsample(engine.page_states(), HOST_STATES, max_cells)
    device_map: PoolMapTier | None = None
    if stats.device:  # one device pool per map: ``device`` (a pool out of service too)
        dev = downsample(engine.device.page_states(device), DEVICE_STATES, max_cells)
        pool = engine.device.pool(device)  # it exists: page_states checked
        device_map = PoolMapTier(
            tier="device",
            index=device,
            pools=len(stats.device),
            out_of_service=stats.device[device].out_of_service,
            states=list(DEVICE_STATES),
            page_bytes=pool.page_bytes,
            **values_of(dev),
        )
    series = history.series()
    return PoolMapResponse(
        **build_info.as_dict(),
        time=time.time(),
        ready=readiness(engine).status == "ready",
        draining=bool(engine.draining),
        summary=PoolMapSummary(
            host_used_bytes=stats.host.used_bytes,
            host_capacity_bytes=stats.host.capacity_bytes,
            device_used_bytes=sum(p.used_bytes for p in stats.device),
            device_capacity_bytes=sum(p.capacity_bytes for p in stats.device),
            entries=stats.entries_ready,
            filling=stats.entries_filling,
            leases_active=stats.leases_active,
            hits=stats.hits,
            misses=stats.misses,
            evictions=stats.evictions,
            adopted_entries=stats.restart.get("adopted_entries", 0),
            dropped_checksum_entries=stats.restart.get("dropped_checksum_entries", 0),
            dropped_layout_entries=stats.restart.get("dropped_layout_entries", 0),
        ),
        host=PoolMapTier(
            tier="host",
            states=list(HOST_STATES),
            page_bytes=stats.host.page_bytes,
            **values_of(host),
        ),
        device=device_map,
        history=PoolMapHistory(
            interval_s=history.interval_s, window_s=history.window_s, **values_of(series)
        ),
    )
