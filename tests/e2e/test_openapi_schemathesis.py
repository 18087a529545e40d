"""schemathesis against a live daemon: every check, without a token and with one, bounded in
examples and time. The schema follows the daemon's auth (no security requirement without a
token, bearer required with one), so both runs must find nothing. The one documented
exception is in schemathesis.toml beside this file."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from embcache.service.daemon_process import DaemonProcess

pytest.importorskip("schemathesis")
TOKEN = "schema-token"
CONFIG = Path(__file__).with_name("schemathesis.toml")


@pytest.mark.parametrize("token", [None, TOKEN], ids=["no-token", "token"])
def test_schemathesis_finds_no_failures(tmp_path: Path, token: str | None) -> None:
    st = shutil.which("st", path=str(Path(sys.executable).parent)) or shutil.which("st")
    assert st, "schemathesis installs the st command"
    flags = ["--host-pool-bytes", "64MiB", "--page-bytes", "64KiB", "--device", "cpu"]
    auth = ["--header", f"Authorization: Bearer {token}"] if token else []
    daemon = DaemonProcess([*flags, *(["--auth-token", token] if token else [])], timeout=60)
    try:
        out = subprocess.run(
            [st, "--config-file", str(CONFIG), "run", f"{daemon.http_url}/openapi.json",
             "--checks", "all", *auth,
             "--max-examples", "40", "--request-timeout", "10", "--workers", "1",
             "--generation-database", "none", "--no-color",
             "--report", "junit", "--report-dir", str(tmp_path)],
            capture_output=True, text=True, timeout=150, cwd=tmp_path,
        )  # fmt: skip
    finally:
        assert daemon.stop(timeout=30) == 0
    summary = out.stdout[-4000:]
    assert out.returncode == 0, out.stdout[-20000:] + out.stderr[-2000:]
    assert "failures" not in summary.splitlines()[-1], summary
    assert " passed" in summary
