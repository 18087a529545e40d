"""Three engines share a real Mooncake Store (master + storage node) on loopback.

The scenario runs in a child process inside a fresh network namespace (``unshare -n``):
the store's transfer engine listens on every interface and has no option to bind
127.0.0.1 only, and a namespace whose only interface is loopback makes that harmless.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tier_servers import mooncake_master_binary

HERE = Path(__file__).resolve().parent


def _skip_reason() -> str | None:
    binary = mooncake_master_binary()
    if binary is None:
        return "Mooncake Store package not installed (pip install -e '.[shared-tier]')"
    probe = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    if "error while loading shared libraries" in probe.stderr:
        return f"mooncake_master cannot load its libraries: {probe.stderr.strip()[:200]}"
    if shutil.which("unshare") is None:
        return "unshare (util-linux) not installed: needed for a loopback-only network namespace"
    ns = subprocess.run(["unshare", "-n", "true"], capture_output=True, text=True, timeout=30)
    if ns.returncode != 0:
        return (
            "cannot create a network namespace (unshare -n: "
            f"{ns.stderr.strip()[:200]}); Mooncake's transfer engine binds all interfaces, "
            "so it only runs here inside a loopback-only namespace"
        )
    return None


def test_three_engines_share_a_mooncake_store(tmp_path: Path) -> None:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    proc = subprocess.run(
        ["unshare", "-n", sys.executable, str(HERE / "mooncake_scenario.py")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"no result (rc={proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    result = json.loads(lines[-1])
    assert result["failed"] == [], (result, proc.stderr[-3000:])
    assert proc.returncode == 0
    assert len(result["passed"]) >= 20
