"""``/docs`` renders in headless Chromium on a machine without internet: Swagger UI comes
from the package, and the page asks nothing of any host but the daemon."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from pagekit import CHROMIUM, DevTools, launch

from embcache.service.config import Settings
from embcache.service.engine import CacheEngine
from embcache.service.observability.metrics import Metrics
from embcache.service.transport.http.app import create_app
from embcache.service.transport.http.testing import serve_in_thread

pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium")
pytest.importorskip("websockets.sync.client")


@pytest.fixture
def offline_browser(tmp_path: Path) -> Iterator[DevTools]:
    with launch(tmp_path / "profile", offline=True) as tools:
        yield tools


@pytest.fixture
def site(shm_name: str) -> Iterator[str]:
    # With a token: the page and its assets are public, the operations still show.
    settings = Settings(host_pool_bytes="4MiB", page_bytes="64KiB", shm_name=shm_name,
                        device="cpu", auth_token="docs-token")  # fmt: skip
    with (
        CacheEngine(settings) as engine,
        serve_in_thread(create_app(engine, settings, Metrics(engine))) as url,
    ):
        yield url


def test_docs_render_offline(offline_browser: DevTools, site: str, tmp_path: Path) -> None:
    browser = offline_browser
    # The resolver rules hold: another host cannot be reached from this browser.
    browser.call("Page.navigate", url="http://cdn.example.invalid/x.js")
    browser.call("Page.navigate", url=f"{site}/docs")
    ops = "document.querySelectorAll('.opblock-summary-path').length"
    count = browser.wait_for(f"{ops} >= 15 && {ops}")
    paths = browser.evaluate(
        "[...document.querySelectorAll('.opblock-summary-path')].map(e => e.textContent)"
    )
    assert "/v1/stats" in paths and "/v1/evict" in paths and count >= 15
    title = browser.evaluate("document.querySelector('.title').textContent")
    assert title.startswith("embcache")
    shot = browser.screenshot(tmp_path / "docs.png")
    assert shot.startswith(b"\x89PNG") and len(shot) > 10_000
    asked = [u for u in browser.requested_urls() if u.startswith("http")]
    assert any(u.endswith("/docs/assets/swagger-ui-bundle.js") for u in asked)
    foreign = [u for u in asked if not u.startswith(site) and "example.invalid" not in u]
    assert foreign == []
