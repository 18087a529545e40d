"""Serve an app on 127.0.0.1 from a background thread: for tests and local tooling.

A real uvicorn server on an ephemeral port exercises the same stack the daemon runs
(lifespan, middleware, HTTP parsing), unlike an in-process ASGI shim.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn

from embcache.service.config import Settings
from embcache.service.transport.http.listener import uvicorn_config


@contextlib.contextmanager
def serve_in_thread(
    app: Any, *, start_timeout_s: float = 10.0, settings: Settings | None = None
) -> Iterator[str]:
    """Run ``app`` until the block ends; yields its base URL (``http://127.0.0.1:PORT``).
    The listener has the daemon's connection guards, from ``settings`` (else the app's)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    if settings is None:
        settings = getattr(
            getattr(app, "state", None), "settings", None
        ) or Settings.model_validate({})
    config = uvicorn_config(app, settings, log_level="warning", lifespan="on", access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="http-test-server", daemon=True
    )
    thread.start()
    try:
        deadline = time.monotonic() + start_timeout_s
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("test HTTP server did not start")
            time.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
