"""Fixtures of the deployment tests: repository paths, YAML loading, settings from env
vars, the daemon's real HTTP routes, and one live daemon for the whole session.

No container engine, no GPU, no network beyond loopback: everything here runs in CI.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from embcache.service.config import Settings

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
KUBERNETES = DEPLOY / "kubernetes"


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def load_yaml() -> Callable[[Path], list[dict[str, Any]]]:
    """Every document of a YAML file (empty documents dropped)."""

    def load(path: Path) -> list[dict[str, Any]]:
        with path.open(encoding="utf-8") as f:
            return [doc for doc in yaml.safe_load_all(f) if doc is not None]

    return load


@pytest.fixture
def settings_from_env(monkeypatch: pytest.MonkeyPatch) -> Callable[[dict[str, str]], Settings]:
    """Settings exactly as the daemon builds them from these EMBCACHE_* variables.

    Checks both ways in: the variables in a clean environment (what a container or unit
    hands the process), and the same values passed as keyword arguments; both must agree.
    """

    def build(env: dict[str, str]) -> Settings:
        unknown = sorted(
            name
            for name in env
            if name.startswith("EMBCACHE_")
            and name.removeprefix("EMBCACHE_").lower() not in Settings.model_fields
        )
        assert not unknown, f"not Settings fields: {unknown}"
        for name in list(os.environ):
            if name.startswith("EMBCACHE_"):
                monkeypatch.delenv(name)
        for name, value in env.items():
            if name.startswith("EMBCACHE_"):
                monkeypatch.setenv(name, value)
        from_env = Settings()
        for name in env:
            if name.startswith("EMBCACHE_"):
                monkeypatch.delenv(name)
        from_kwargs = Settings(
            **{
                name.removeprefix("EMBCACHE_").lower(): value
                for name, value in env.items()
                if name.startswith("EMBCACHE_")
            }
        )
        assert from_env == from_kwargs
        return from_env

    return build


@pytest.fixture(scope="session")
def serves_get() -> Callable[[str], bool]:
    """Whether the daemon's real FastAPI app (built without a pool) routes ``GET path``.

    Matches against ``app.routes`` the way Starlette routes a request, so routers that
    FastAPI includes lazily count as well.
    """
    from starlette.routing import Match

    from embcache.service.observability.metrics import Metrics
    from embcache.service.transport.http.app import create_app

    engine = SimpleNamespace()  # create_app only keeps it; nothing is called at build time
    app = create_app(engine, Settings(), Metrics(engine))

    def serves(path: str) -> bool:
        scope = {"type": "http", "method": "GET", "path": path, "root_path": "",
                 "headers": [], "query_string": b"", "app": app}  # fmt: skip
        return any(route.matches(scope)[0] is Match.FULL for route in app.routes)

    assert serves("/livez") and not serves("/no-such-route")
    return serves


def _embcache_command() -> list[str]:
    """The installed console script (what the image's ENTRYPOINT runs), else the module."""
    script = shutil.which("embcache", path=str(Path(sys.executable).parent))
    return [script] if script else [sys.executable, "-m", "embcache.service.cli"]


@pytest.fixture(scope="session")
def live_daemon() -> Iterator[dict[str, Any]]:
    """``embcache serve`` as deployed (a token, a Unix socket) but on loopback and
    ephemeral ports; yields its ready line plus ``token``."""
    shm = f"embcache-deploytest-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    token = uuid.uuid4().hex
    socket_dir = Path(tempfile.mkdtemp(prefix="embcache-deploytest-"))  # short: AF_UNIX limit
    cmd = [
        *_embcache_command(),
        "serve",
        "--grpc-port", "0",
        "--http-port", "0",
        "--shm-name", shm,
        "--host-pool-bytes", "64MiB",
        "--device", "cpu",
        "--log-level", "warning",
        "--grpc-socket", str(socket_dir / "embcache.sock"),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBCACHE_")}
    env["EMBCACHE_AUTH_TOKEN"] = token  # as from the Secret, not on the command line
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
    )
    assert proc.stdout is not None
    ready: dict[str, Any] | None = None
    try:
        deadline = time.monotonic() + 60
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            while ready is None and time.monotonic() < deadline and proc.poll() is None:
                if sel.select(timeout=0.5):
                    line = proc.stdout.readline()
                    if line.startswith("{") and json.loads(line).get("event") == "ready":
                        ready = json.loads(line)
        if ready is None:
            pytest.fail(f"daemon did not print its ready line: {cmd}")
        yield {**ready, "token": token}
    finally:
        if proc.poll() is None:
            proc.terminate()  # the daemon drains (and, warm, keeps its segment)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        proc.stdout.close()
        shutil.rmtree(socket_dir, ignore_errors=True)
        for leftover in (shm, f"{shm}.index"):  # warm restart (as deployed) keeps them
            Path("/dev/shm", leftover).unlink(missing_ok=True)
