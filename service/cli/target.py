"""Where the operator commands find the daemon: one ``--target`` for both planes.

``--target`` (env ``EMBCACHE_TARGET``) is the daemon's HTTP address, ``[http[s]://]HOST[:PORT]``
(port 7471 when left out). REST calls go there; the commands that speak gRPC (``put``,
``get``) first ask ``GET /v1/stats`` for the daemon's gRPC port and use it on the same host.
Without a target, the address comes from the settings the daemon reads (``EMBCACHE_HTTP_HOST``,
``EMBCACHE_HTTP_PORT``, https with ``EMBCACHE_TLS_CERT``), so the commands on a daemon's own
node find it as configured. ``--token`` (env ``EMBCACHE_AUTH_TOKEN``) and ``--ca-cert`` (env
``EMBCACHE_TLS_CERT``: the certificate to trust for https) apply to both planes.
"""

# No ``from __future__ import annotations``: typer reads the Annotated[...] metadata.
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

import httpx
import typer

from embcache.service.cli.output import fail

DEFAULT_HTTP_PORT = 7471
_WILDCARD_HOSTS = {"", "0.0.0.0", "::", "[::]"}

TargetOpt = Annotated[
    str | None,
    typer.Option(
        "--target",
        envvar="EMBCACHE_TARGET",
        help="The daemon's HTTP address, HOST[:PORT] or http(s)://HOST[:PORT]; its gRPC "
        "port is asked from it. Default: EMBCACHE_HTTP_HOST/PORT, else 127.0.0.1:7471.",
        show_default=False,
    ),
]
TokenOpt = Annotated[
    str | None,
    typer.Option("--token", envvar="EMBCACHE_AUTH_TOKEN", help="Bearer token.", show_default=False),
]
CaOpt = Annotated[
    Path | None,
    typer.Option(
        "--ca-cert",
        envvar="EMBCACHE_TLS_CERT",
        help="Certificate (PEM) to trust for https and gRPC over TLS.",
        show_default=False,
    ),
]


def http_url(target: str | None, ca_cert: Path | None = None) -> str:
    """The base URL of the daemon's HTTP plane; exit 2 naming a malformed target."""
    if not target:
        host = os.environ.get("EMBCACHE_HTTP_HOST", "127.0.0.1")
        host = "127.0.0.1" if host in _WILDCARD_HOSTS else host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        env_port = os.environ.get("EMBCACHE_HTTP_PORT", str(DEFAULT_HTTP_PORT))
        target = f"{'https' if ca_cert else 'http'}://{host}:{env_port}"
    elif "://" not in target:
        target = f"{'https' if ca_cert else 'http'}://{target}"
    parts = urlsplit(target)
    try:
        port = parts.port or DEFAULT_HTTP_PORT
    except ValueError:
        raise fail(f"Invalid value for '--target': bad port in {target!r}", code=2) from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        raise fail(
            f"Invalid value for '--target': {target!r} is not [http[s]://]HOST[:PORT]", code=2
        )
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}:{port}"


@dataclass(frozen=True)
class Daemon:
    """A daemon to talk to: its HTTP URL, token and the certificate to trust."""

    url: str
    token: str | None = None
    ca_cert: Path | None = None

    @classmethod
    def of(cls, target: str | None, token: str | None, ca_cert: Path | None) -> "Daemon":
        return cls(http_url(target, ca_cert), token or None, ca_cert)

    def request(
        self, method: str, path: str, flags: dict[str, str] | None = None, **kwargs: Any
    ) -> Any:
        """One REST call; exits with one readable line on connection or API errors. A 422
        names the flag at fault (``flags``: request field -> flag), as local checks do."""
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        verify: bool | str = str(self.ca_cert) if self.ca_cert else True
        try:
            with httpx.Client(
                base_url=self.url, headers=headers, verify=verify, timeout=30
            ) as client:
                resp = client.request(method, path, **kwargs)
        except httpx.RemoteProtocolError:
            raise fail(
                f"{self.url} does not answer HTTP/1.1: it looks like the daemon's gRPC port; "
                f"give --target the HTTP address (port {DEFAULT_HTTP_PORT} by default)"
            ) from None
        except httpx.ConnectError as exc:
            raise fail(
                f"cannot reach the daemon at {self.url} ({_reason(exc)}): is it running "
                "(embcache serve)? Point --target or EMBCACHE_TARGET at its HTTP address"
            ) from None
        except httpx.HTTPError as exc:
            raise fail(f"cannot reach the daemon at {self.url}: {exc}") from None
        if resp.status_code >= 400:
            raise _api_error(method, path, resp, flags or {})
        return resp.json()

    def grpc_target(self) -> str:
        """``HOST:PORT`` of the daemon's gRPC plane, asked from its HTTP plane."""
        stats = self.request("GET", "/v1/stats")
        port = stats.get("grpc_port")
        if not port:
            raise fail(f"the daemon at {self.url} does not say its gRPC port (an older one?)")
        host = urlsplit(self.url).hostname or "127.0.0.1"
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _reason(exc: Exception) -> str:
    text = str(exc)
    return "connection refused" if "refused" in text.lower() else text or type(exc).__name__


def _api_error(method: str, path: str, resp: httpx.Response, flags: dict[str, str]) -> typer.Exit:
    try:
        body = resp.json()
    except ValueError:
        return fail(f"{method} {path} -> {resp.status_code} {resp.text[:200]}")
    if resp.status_code == 422:
        for err in body.get("details", {}).get("errors", []):
            field = next((str(p) for p in reversed(err.get("loc", [])) if str(p) in flags), None)
            if field is not None:
                return fail(f"Invalid value for '{flags[field]}': {err.get('msg')}", code=2)
    if resp.status_code == 401:
        return fail(f"{method} {path} -> 401: the daemon needs a token (--token or "
                    "EMBCACHE_AUTH_TOKEN), or this one is wrong")  # fmt: skip
    detail = f"{body.get('error', 'error')}: {body.get('message', resp.text)}"
    return fail(f"{method} {path} -> {resp.status_code} {detail}")
