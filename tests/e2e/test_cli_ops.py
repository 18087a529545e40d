"""Every operator command against a live daemon (``embcache serve`` in a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from embcache.service.cli import app
from embcache.service.daemon_process import DaemonProcess

TOKEN = "cli-test-token"


@pytest.fixture(scope="module")
def daemon() -> Iterator[dict[str, Any]]:
    flags = ["--host-pool-bytes", "64MiB", "--page-bytes", "64KiB", "--device", "cpu"]
    child = DaemonProcess([*flags, "--auth-token", TOKEN], timeout=60)
    try:
        yield child.ready
    finally:
        child.stop(timeout=15)


@pytest.fixture
def cli(daemon: dict[str, Any]) -> Any:
    runner = CliRunner()
    env = {"EMBCACHE_HTTP_PORT": str(daemon["http_port"]),
           "EMBCACHE_GRPC_PORT": str(daemon["grpc_port"]), "EMBCACHE_AUTH_TOKEN": TOKEN,
           "COLUMNS": "200"}  # fmt: skip

    def invoke(*args: str, token: bool = True) -> Any:
        run_env = dict(env) if token else {**env, "EMBCACHE_AUTH_TOKEN": ""}
        return runner.invoke(app, list(args), env=run_env)

    return invoke


def test_put_get_roundtrip_npy_and_safetensors(cli: Any, tmp_path: Path) -> None:
    arr = np.arange(24, dtype=np.float32).reshape(4, 6)
    np.save(tmp_path / "a.npy", arr)
    result = cli("put", str(tmp_path / "a.npy"), "doc/1")
    assert result.exit_code == 0, result.output
    assert "stored doc/1 float32 [4, 6]" in result.output
    assert "already present" in cli("put", str(tmp_path / "a.npy"), "doc/1").output
    result = cli("get", "doc/1", str(tmp_path / "out.npy"))
    assert result.exit_code == 0, result.output
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), arr)

    bf = torch.randn(3, 5).to(torch.bfloat16)
    save_file({"emb": bf, "other": torch.zeros(2)}, str(tmp_path / "b.safetensors"))
    result = cli("put", str(tmp_path / "b.safetensors"), "doc/2")
    assert result.exit_code == 2 and "--tensor" in result.output  # two tensors: pick one
    result = cli("put", str(tmp_path / "b.safetensors"), "doc/2", "--tensor", "emb")
    assert result.exit_code == 0, result.output
    result = cli("get", "doc/2", str(tmp_path / "out.safetensors"), "--tensor", "x")
    assert result.exit_code == 0, result.output
    assert torch.equal(load_file(str(tmp_path / "out.safetensors"))["x"], bf)
    result = cli("get", "doc/2", str(tmp_path / "bf.npy"))  # numpy has no bfloat16
    assert result.exit_code == 1 and "safetensors" in result.output

    assert cli("get", "nope", str(tmp_path / "n.npy")).exit_code == 1
    (tmp_path / "x.txt").write_text("hi")
    assert cli("put", str(tmp_path / "x.txt"), "k").exit_code == 2


def test_stats_and_ls(cli: Any, tmp_path: Path) -> None:
    np.save(tmp_path / "s.npy", np.ones((64, 1024), dtype=np.float32))  # 256 KiB
    assert cli("put", str(tmp_path / "s.npy"), "stats-key").exit_code == 0
    result = cli("stats")
    assert result.exit_code == 0, result.output
    assert "host pool" in result.output and "64.0 MiB" in result.output
    body = json.loads(cli("stats", "--json").output)
    assert body["entries_ready"] >= 1 and body["host"]["capacity_bytes"] == 64 * 1024**2

    result = cli("ls", "--sort", "size")  # not a terminal: one tab-separated record a line
    assert result.exit_code == 0, result.output
    assert "stats-key\tready\tfloat32\t64x1024\t262144\t" in result.output
    page = json.loads(cli("ls", "--json", "--sort", "size", "--limit", "1").output)
    assert page["items"][0]["key"] == "stats-key"
    assert cli("ls", "--state", "bogus").exit_code == 2  # checked here, as typer does


def test_evict(cli: Any, tmp_path: Path) -> None:
    np.save(tmp_path / "e.npy", np.ones((8, 8), dtype=np.float32))
    for key in ("ev/1", "ev/2"):
        assert cli("put", str(tmp_path / "e.npy"), key).exit_code == 0
    result = cli("evict", "ev/1", "ev/missing")
    assert result.exit_code == 1
    assert "evicted   ev/1" in result.output and "not found ev/missing" in result.output
    result = cli("evict", "ev/2")
    assert result.exit_code == 0 and "freed 1 entries" in result.output
    result = cli("evict", "--free", "1MiB")
    assert result.exit_code == 0 and "freed" in result.output
    assert cli("evict").exit_code == 2
    assert cli("evict", "--free", "lots").exit_code == 2
    result = cli("evict", "ev/1", "--device-pool", "0")  # no device pools here: 409
    assert result.exit_code == 1 and "409" in result.output, result.output
    assert cli("evict", "ev/1", "--device-pool", "-1").exit_code == 2


def test_auth_token_is_required(cli: Any) -> None:
    result = cli("stats", token=False)
    assert result.exit_code == 1 and "401" in result.output


def test_unreachable_daemon_is_reported() -> None:
    with_port = {"EMBCACHE_HTTP_PORT": "1", "COLUMNS": "200"}
    result = CliRunner().invoke(app, ["stats"], env=with_port)
    assert result.exit_code == 1 and "cannot reach the daemon" in result.output


def test_bench(cli: Any, tmp_path: Path, daemon: dict[str, Any]) -> None:
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "tiny.py").write_text(
        "import os\n"
        "print('| size | GB/s |')\n"
        "print('| 1 KiB | 1.0 |')\n"
        "print('port', os.environ['EMBCACHE_HTTP_PORT'])\n"
        "import sys\n"
        "print('argv', sys.argv[1:])\n"
    )
    (bench / "_helper.py").write_text("raise SystemExit(3)\n")  # not a benchmark
    result = cli("bench", "--bench-dir", str(bench), "--list")
    assert result.exit_code == 0 and result.output.split() == ["tiny"]
    result = cli("bench", "--bench-dir", str(bench))
    assert result.exit_code == 0, result.output
    assert "| 1 KiB | 1.0 |" in result.output and f"port {daemon['http_port']}" in result.output
    result = cli("bench", "--bench-dir", str(bench), "--", "--reps", "2")
    assert result.exit_code == 0 and "argv ['--reps', '2']" in result.output
    (bench / "broken.py").write_text("raise SystemExit('boom')\n")
    result = cli("bench", "--bench-dir", str(bench), "--only", "broken")
    assert result.exit_code == 1 and "boom" in result.output
    assert cli("bench", "--bench-dir", str(tmp_path / "none")).exit_code == 2


def test_serve_subprocess_cli_stats(daemon: dict[str, Any]) -> None:
    """The installed entry point, end to end in its own process."""
    env = {**os.environ, "EMBCACHE_HTTP_PORT": str(daemon["http_port"]),
           "EMBCACHE_AUTH_TOKEN": TOKEN}  # fmt: skip
    cmd = [sys.executable, "-m", "embcache.service.cli", "stats", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60, check=True)
    assert json.loads(out.stdout)["host"]["tier"] == "host"
