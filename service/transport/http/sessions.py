"""``GET /v1/sessions`` and ``DELETE /v1/sessions/{id}``: the sessions open on the data
plane and the clients holding leases without one, and dropping one (``session/admin.py``).
Token-protected like every ``/v1`` route."""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from embcache.service.transport.http.records import derived
from embcache.service.transport.http.routes import BEARER, ERRORS
from embcache.service.transport.session.admin import SessionAdmin, SessionView


@derived(SessionView)
class SessionModel(BaseModel):
    """One session as operators see it, or a client's leases taken without one."""


class SessionList(BaseModel):
    sessions: list[SessionModel]


class DroppedSession(BaseModel):
    session: SessionModel
    leases_ended: int = Field(description="Leases the drop ended.")


router = APIRouter(prefix="/v1", responses=ERRORS, dependencies=[BEARER])


def _admin(request: Request) -> SessionAdmin:
    admin: SessionAdmin = request.app.state.sessions
    return admin


def _model(view: SessionView) -> SessionModel:
    return SessionModel(**view.to_dict())


@router.get("/sessions", response_model=SessionList, summary="List the open sessions")
def list_sessions(request: Request) -> SessionList:
    return SessionList(sessions=[_model(v) for v in _admin(request).views()])


@router.delete(
    "/sessions/{session_id}",
    response_model=DroppedSession,
    summary="End a session: its leases end and its stream or connection closes",
)
def drop_session(request: Request, session_id: str) -> DroppedSession:
    view, ended = _admin(request).drop(session_id)  # NotFound -> 404
    return DroppedSession(session=_model(view), leases_ended=ended)
