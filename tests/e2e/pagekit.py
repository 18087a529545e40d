"""Headless Chromium for the page tests (Debian's ``chromium``), driven over the DevTools
protocol: commands, events kept for later, console errors, screenshots."""

from __future__ import annotations

import base64
import contextlib
import json
import re
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CHROMIUM = Path("/usr/bin/chromium")


class DevTools:
    """Just enough of the Chrome DevTools protocol: commands, and events kept for later."""

    def __init__(self, ws: Any) -> None:
        self._ws = ws
        self._next_id = 0
        self.events: list[dict[str, Any]] = []

    def call(self, method: str, timeout: float = 15.0, **params: Any) -> dict[str, Any]:
        self._next_id += 1
        self._ws.send(json.dumps({"id": self._next_id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(method)
            msg = json.loads(self._ws.recv(timeout=left))
            if msg.get("id") == self._next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            if "method" in msg:
                self.events.append(msg)

    def evaluate(self, expression: str) -> Any:
        out = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in out:
            raise RuntimeError(out["exceptionDetails"])
        return out["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 20.0) -> Any:
        deadline = time.monotonic() + timeout
        guarded = f"(() => {{ try {{ return ({expression}); }} catch (e) {{ return null; }} }})()"
        while time.monotonic() < deadline:
            value = self.evaluate(guarded)  # null while the page is still loading
            if value:
                return value
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for: {expression}")

    def errors(self) -> list[str]:
        found = []
        for ev in self.events:
            method, params = ev["method"], ev.get("params", {})
            if method == "Runtime.exceptionThrown":
                found.append(json.dumps(params["exceptionDetails"])[:500])
            elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                found.append(json.dumps(params.get("args"))[:500])
            elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
                found.append(params["entry"].get("text", "")[:500])
        return found

    def requested_urls(self) -> list[str]:
        """Every URL the page asked for so far (Network events)."""
        return [
            ev["params"]["request"]["url"]
            for ev in self.events
            if ev["method"] == "Network.requestWillBeSent"
        ]

    def screenshot(self, path: Path) -> bytes:
        shot = base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"])
        path.write_bytes(shot)
        return shot


@contextlib.contextmanager
def launch(profile: Path, *, offline: bool = False) -> Iterator[DevTools]:
    """Headless Chromium with a fresh profile, driven over DevTools. ``offline``: every
    host but 127.0.0.1 fails to resolve, as on a machine without internet."""
    cmd = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--no-first-run", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", "--disable-extensions", f"--user-data-dir={profile}",
           "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
           "--window-size=1400,1000"]  # fmt: skip
    if offline:
        cmd.append("--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1")
    cmd.append("about:blank")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    found = threading.Event()

    def read_stderr() -> None:  # keeps draining so Chromium never blocks on a full pipe
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if "DevTools listening on" in line:
                found.set()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        if not found.wait(30):
            raise RuntimeError("chromium did not start:\n" + "".join(lines[-20:]))
        endpoint = re.search(r"ws://127\.0\.0\.1:(\d+)/", "".join(lines))
        assert endpoint is not None
        with urllib.request.urlopen(f"http://127.0.0.1:{endpoint.group(1)}/json/list") as r:
            pages = [t for t in json.load(r) if t["type"] == "page"]
        ws_url = pages[0]["webSocketDebuggerUrl"]
        from websockets.sync import client as ws_client

        with ws_client.connect(ws_url, max_size=64 * 1024 * 1024, open_timeout=10) as ws:
            tools = DevTools(ws)
            for domain in ("Runtime", "Log", "Page", "Network"):
                tools.call(f"{domain}.enable")
            tools.call("Emulation.setDeviceMetricsOverride", width=1400, height=1000,
                       deviceScaleFactor=1, mobile=False)  # fmt: skip
            yield tools
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        reader.join(timeout=5)
        if proc.stderr is not None:
            proc.stderr.close()
