"""The pool-map page in headless Chromium, driven over the DevTools protocol.

Checks that the page renders the pools and the entries a test put, keeps itself up to date
without reloading, honours a token given in the URL fragment, and logs no console errors.
Skipped where Debian's ``chromium`` is not installed.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
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


@pytest.fixture
def busy_site(shm_name: str) -> Iterator[tuple[str, CacheEngine]]:
    """A CPU-mode daemon's app (no device pool) with one fragmented entry to search for."""
    settings = Settings(host_pool_bytes="64MiB", page_bytes="64KiB", shm_name=shm_name,
                        device="cpu")  # fmt: skip
    with CacheEngine(settings) as engine:
        pad = torch.ones(3 * 64 * 1024, dtype=torch.uint8)
        for i in range(1024 // 3):  # the whole pool in 3-page entries
            engine.put(f"pad/{i}", pad)
        engine.evict(["pad/1", "pad/3"])  # holes the next entry is split across
        engine.put("video/clip-0042.mp4#frames", torch.ones(5 * 64 * 1024, dtype=torch.uint8))
        engine.evict([f"pad/{i}" for i in range(12, 1024 // 3)])  # room for the load
        with serve_in_thread(create_app(engine, settings, Metrics(engine))) as url:
            yield url, engine


def _load(url: str, stop: threading.Event, done: list[int], max_pairs: int = 2000) -> None:
    """Put + read pairs of new 1 MiB entries over REST until ``stop`` (or ``max_pairs``);
    each pair also deletes the entry of 16 pairs before, so the pool stays half free."""
    body = os.urandom(1024 * 1024)
    with httpx.Client(base_url=url, timeout=30) as client:
        for i in range(max_pairs):
            if stop.is_set():
                return
            key = f"load/{i}"
            put = client.put(f"/v1/entries/{key}?dtype=uint8&shape={len(body)}", content=body)
            assert put.status_code == 201, put.text
            got = client.get(f"/v1/entries/{key}/data")
            assert got.status_code == 200 and got.content == body
            if i >= 16:
                assert client.delete(f"/v1/entries/load/{i - 16}").status_code == 200
            done[0] += 1


def test_pool_map_shows_cpu_load_and_highlights_a_key(
    browser: DevTools, busy_site: tuple[str, CacheEngine], tmp_path: Path
) -> None:
    url, engine = busy_site
    stop, done = threading.Event(), [0]
    loader = threading.Thread(target=_load, args=(url, stop, done), daemon=True)
    browser.call("Page.navigate", url=url + "/")
    loader.start()
    try:
        # Host bytes and operations are non-zero under load although no device copy happens.
        io = browser.wait_for(
            "(() => { const t = document.getElementById('host-io').textContent;"
            " return /[1-9]/.test(t) && t; })()",
            timeout=30,
        )
        assert io.endswith("/s") and not io.startswith("0 B"), io
        foot = browser.evaluate("document.getElementById('host-io-foot').textContent")
        assert re.fullmatch(r"in [1-9][\d.]* \S+/s · out [1-9][\d.]* \S+/s", foot), foot
        ops = browser.wait_for(
            "(() => { const t = document.getElementById('ops').textContent;"
            " return Number(t.replace(/,/g, '')) > 0 && t; })()"
        )
        latency = browser.wait_for(
            "(() => { const t = document.getElementById('ops-foot').textContent;"
            " return t.startsWith('p50') && t; })()"
        )
        assert re.fullmatch(r"p50 [\d.]+ (µs|ms|s) · p99 [\d.]+ (µs|ms|s)", latency), latency
        bw = browser.evaluate("document.getElementById('bw-foot').textContent")
        assert bw == "no device copies", bw  # CPU mode: the copy card says so, not "idle"

        # Search a key: its pages are outlined on the host grid, and only while it is found.
        key = "video/clip-0042.mp4#frames"
        info = engine.entry_info(key)
        assert info is not None
        runs = info.page_runs
        assert len(runs) > 1  # split across holes: several runs to outline
        browser.evaluate(f"document.getElementById('search-key').value = {key!r}")
        browser.evaluate("document.getElementById('search').requestSubmit()")
        cells = browser.wait_for(
            "Number(document.getElementById('grid-host').dataset.foundCells) || 0"
        )
        per = httpx.get(f"{url}/v1/pool-map").json()["host"]["pages_per_cell"]
        expect = {p // per for first, n in runs for p in range(first, first + n)}
        assert cells == len(expect), (cells, runs)
        assert _found_pixels(browser) > 0
        legend = browser.evaluate("document.getElementById('legend-host').textContent")
        assert "searched key" in legend
        time.sleep(1.5)  # the next refreshes keep the outline
        assert browser.evaluate("document.getElementById('grid-host').dataset.foundCells") == str(
            cells
        )
        browser.screenshot(tmp_path / "poolmap_cpu_load.png")
        if out_dir := os.environ.get("EMBCACHE_SCREENSHOT_DIR"):
            shutil.copy(tmp_path / "poolmap_cpu_load.png", Path(out_dir) / "poolmap_cpu_load.png")
        browser.evaluate("document.getElementById('search-clear').click()")
        browser.wait_for("document.getElementById('grid-host').dataset.foundCells === '0'")
        assert _found_pixels(browser) == 0
    finally:
        stop.set()
        loader.join(timeout=60)
    assert not loader.is_alive() and done[0] > 0, ops
    assert [e for e in browser.errors() if "404" not in e] == []


def _found_pixels(browser: DevTools) -> int:
    """Pixels of the host grid painted in the searched key's outline colour."""
    return browser.evaluate(
        "(() => { const c = document.getElementById('grid-host');"
        " const want = getComputedStyle(document.documentElement).getPropertyValue('--found')"
        "   .trim().match(/[0-9a-f]{2}/gi).map((h) => parseInt(h, 16));"
        " const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data; let n = 0;"
        " for (let i = 0; i < d.length; i += 4)"
        "   if (d[i] === want[0] && d[i + 1] === want[1] && d[i + 2] === want[2]) n++;"
        " return n; })()"
    )
