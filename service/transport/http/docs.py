"""The API description: Swagger UI served from the package, and what the schema says
beyond the models.

``/docs`` is FastAPI's Swagger UI page with its script, stylesheet and icon served from
``/docs/assets/`` out of the ``swagger-ui-bundle-v2`` package (Swagger UI's own release
files, Apache-2.0), so the page renders where no CDN can be reached. The schema gets the
bounds that come from this daemon's settings (``ttl_s`` at most ``max_lease_ttl_s``) and
its auth as it is: with a token, every route but the probes and the page requires the bearer
scheme and documents 401; without one, no route lists a security requirement or a 401 (a
client that follows the schema sends no token, and the daemon takes it). Every route
documents the 403 of a Host or Origin the daemon does not serve (hosts.py).
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from swagger_ui_bundle import swagger_ui_path

from embcache.service.config import Settings
from embcache.service.transport.http.middleware import is_public

ASSETS = "/docs/assets"
_TTL_MODELS = ("GetRequest", "RenewRequest")  # bodies whose ttl_s the settings bound
_METHODS = {"get", "head", "put", "post", "delete", "patch", "options"}


def mount_docs(app: FastAPI) -> None:
    """``/docs`` (Swagger UI), its OAuth2 redirect page and ``/docs/assets/*``."""

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title=f"{app.title} · API",
            swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS}/favicon-32x32.png",
            oauth2_redirect_url="/docs/oauth2-redirect",
        )

    @app.get("/docs/oauth2-redirect", include_in_schema=False)
    async def oauth2_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    app.mount(ASSETS, StaticFiles(directory=str(swagger_ui_path)), name="docs-assets")


def allowed_methods(request: Request) -> str:
    """``Allow`` for a 405: the methods the schema documents at this path (empty if the path
    fits no documented one)."""
    path = request.url.path
    methods: set[str] = set()
    for template, operations in request.app.openapi().get("paths", {}).items():
        if re.fullmatch(re.sub(r"\\{[^}]+\\}", "[^/]+", re.escape(template)), path):
            methods.update(m.upper() for m in operations if m in _METHODS)
    return ", ".join(sorted(methods))


def bound_schema(app: FastAPI, settings: Settings) -> None:
    """Build the OpenAPI document once, with the bounds this daemon's settings set."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title,
                version=app.version,
                summary=app.summary,
                description=app.description,
                routes=app.routes,
            )
            _auth_as_configured(schema, settings.auth_token is not None)
            models = schema.get("components", {}).get("schemas", {})
            for name in _TTL_MODELS:
                ttl = models.get(name, {}).get("properties", {}).get("ttl_s", {})
                for choice in ttl.get("anyOf", [ttl]):
                    if choice.get("type") == "number":
                        choice["maximum"] = settings.max_lease_ttl_s
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


_ERROR_REF = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
_UNAUTHORIZED = {
    "description": "A token is set and was not given, or is wrong.",
    "content": _ERROR_REF,
}
_MISDIRECTED = {
    "description": "The Host is not a name this daemon serves, or a write came from a page "
    "of another origin (docs/operators.md, Security).",
    "content": _ERROR_REF,
}


def _auth_as_configured(schema: dict[str, Any], token: bool) -> None:
    """Security requirements and 401s as this daemon applies them (module docstring)."""
    schemes = schema.get("components", {}).get("securitySchemes", {})
    for path, operations in schema.get("paths", {}).items():
        for method, operation in operations.items():
            if method not in _METHODS:
                continue
            responses = operation.setdefault("responses", {})
            responses.setdefault("403", _MISDIRECTED)
            if token and not is_public(path) and schemes:
                operation["security"] = [{name: []} for name in schemes]
                responses.setdefault("401", _UNAUTHORIZED)
            else:
                operation.pop("security", None)
                responses.pop("401", None)
    if not token:
        schema.get("components", {}).pop("securitySchemes", None)
