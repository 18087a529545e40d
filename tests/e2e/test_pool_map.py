"""The pool-map page in headless Chromium, driven over the DevTools protocol.

Checks that the page renders the pools and the entries a test put, keeps itself up to date
without reloading, honours a token given in the URL fragment, and logs no console errors.
Skipped where Debian's ``chromium`` is not installed.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from pagekit import CHROMIUM, DevTools, launch

from embcache import build_info
from embcache.service.config import Settings
from embcache.service.device.pool import DevicePool
from embcache.service.engine import CacheEngine
from embcache.service.observability.metrics import Metrics
from embcache.service.transport.http.app import create_app
from embcache.service.transport.http.testing import serve_in_thread

TOKEN = "page-token"
pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium")
ws_client = pytest.importorskip("websockets.sync.client")


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[DevTools]:
    with launch(tmp_path / "profile") as tools:
        yield tools


@pytest.fixture
def site(shm_name: str) -> Iterator[tuple[str, CacheEngine]]:
    settings = Settings(host_pool_bytes="16MiB", page_bytes="16KiB", shm_name=shm_name,
                        device="cpu", auth_token=TOKEN)  # fmt: skip
    # A device pool in plain memory stands in for HBM, so the device grid is drawn too.
    pool = DevicePool(torch.device("cpu"), 4 * 1024**2, 16 * 1024)
    with CacheEngine(settings, device_pools=[pool]) as engine:
        engine.put("video/clip-0042.mp4#frames", torch.ones(512, 1024, dtype=torch.bfloat16))
        for i in range(12):
            engine.put(f"img/{i:03d}.jpg", torch.ones(4 * (i + 1), 1024, dtype=torch.float32))
        engine.put("audio/podcast-ep7.wav", torch.ones(300, 1024, dtype=torch.float16))
        engine.evict(["img/003.jpg", "img/007.jpg"])  # holes: free runs between entries
        engine.get(["img/011.jpg", "img/010.jpg", "missing"], owner="decoder-0")
        on_device, _ = engine.device.get(["img/004.jpg", "img/005.jpg", "img/009.jpg"], "d1")
        engine.release([r.lease.lease_id for r in on_device[:2] if r is not None])
        with serve_in_thread(create_app(engine, settings, Metrics(engine))) as url:
            yield url, engine


def test_pool_map_page(browser: DevTools, site: tuple[str, CacheEngine], tmp_path: Path) -> None:
    url, engine = site
    # Without a token the page asks for one instead of failing silently.
    browser.call("Page.navigate", url=url + "/")
    browser.wait_for("!document.getElementById('auth').hidden")
    assert browser.evaluate("document.getElementById('health').textContent") == "token needed"
    # Chromium logs the refused requests as network errors: leave the page, read every
    # event sent so far (they precede the reply to the next call), then forget them.
    browser.call("Page.navigate", url="about:blank")
    browser.wait_for("location.href === 'about:blank'")
    time.sleep(0.3)
    browser.evaluate("1")
    browser.events.clear()

    browser.call("Page.navigate", url=f"{url}/#token={TOKEN}")
    keys = "[...document.querySelectorAll('#table-size td.key')].map(td => td.textContent)"
    shown = browser.wait_for(f"(() => {{ const k = {keys}; return k.length >= 8 && k; }})()")
    assert shown[0] == "video/clip-0042.mp4#frames"  # the largest entry tops the list
    assert "audio/podcast-ep7.wav" in shown
    assert browser.evaluate("location.hash") == ""  # the token left the address bar
    assert browser.evaluate("localStorage.getItem('embcache.token')") == TOKEN
    assert browser.evaluate("document.getElementById('health').textContent") == "ready"
    legend = browser.evaluate("document.getElementById('legend-host').textContent")
    assert "leased" in legend and "ready" in legend and "free" in legend
    painted = browser.evaluate(
        "(() => { const c = document.getElementById('grid-host');"
        " const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
        " let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i]) n++; return n; })()"
    )
    assert painted > 1000  # the host grid is drawn
    assert browser.evaluate("document.getElementById('device-pool').hidden") is False
    device_legend = browser.evaluate("document.getElementById('legend-device').textContent")
    assert "resident" in device_legend and "leased" in device_legend

    # Live update without reloading: a marker set on window survives the refresh.
    browser.evaluate("window.__noReload = 1")
    engine.put("fresh/after-load", torch.ones(700, 1024, dtype=torch.float32))
    recent = "[...document.querySelectorAll('#table-recent td.key')].map(td => td.textContent)"
    browser.wait_for(f"{recent}[0] === 'fresh/after-load'")
    browser.wait_for(f"{keys}[0] === 'fresh/after-load'")
    assert browser.evaluate("window.__noReload") == 1

    # The hit-rate card labels its two figures: the last interval, and lifetime.
    label = browser.evaluate("document.getElementById('hit-rate-label').textContent")
    assert re.fullmatch(r"last \d+ s(: no lookups)?", label), label
    foot = browser.evaluate("document.querySelector('#hit-foot').parentNode.textContent")
    assert "lifetime" in foot and "lookups" in foot, foot
    build = browser.evaluate("document.getElementById('build').textContent")
    assert build == f"embcache {build_info.version()} · commit {build_info.git_commit()}"

    # The key search: an entry in words, and an absent key said to be absent.
    result = "document.getElementById('search-result')"
    browser.evaluate("document.getElementById('search-key').value = 'img/011.jpg'")
    browser.evaluate("document.getElementById('search').requestSubmit()")
    found = browser.wait_for(f"{result}.dataset.found === '1' && {result}.textContent")
    assert found.startswith("img/011.jpg: ready, float32 [48, 1024]") and "1 leases" in found
    browser.evaluate("document.getElementById('search-key').value = 'no/such key'")
    browser.evaluate("document.getElementById('search').requestSubmit()")
    assert browser.wait_for(f"{result}.dataset.found === '0' && {result}.textContent") == (
        "No entry no/such key."
    )

    shot = browser.screenshot(tmp_path / "pool-map.png")
    if out_dir := os.environ.get("EMBCACHE_SCREENSHOT_DIR"):
        shutil.copy(tmp_path / "pool-map.png", Path(out_dir) / "pool-map.png")
    assert shot.startswith(b"\x89PNG") and len(shot) > 10_000
    # The one refused request is the lookup of the absent key (a 404, logged by Chromium).
    assert [e for e in browser.errors() if "404" not in e] == []
