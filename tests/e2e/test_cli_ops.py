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
from rich.console import Console
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from embcache.service.cli import app
from embcache.service.cli.ops import (
    LS_COLUMNS,
    SESSION_COLUMNS,
    entries_table,
    sessions_table,
    stats_table,
)
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
    result = cli("put", str(tmp_path / "a.npy"), "doc/1")  # piped: a header, one record
    assert result.exit_code == 0, result.output
    assert (
        result.stdout
        == "key\tresult\tdtype\tshape\tnbytes\tfile\ndoc/1\tstored\tfloat32\t4x6\t96\t\n"
    )
    again = json.loads(cli("put", str(tmp_path / "a.npy"), "doc/1", "--json").stdout)
    assert again == {"key": "doc/1", "result": "present", "dtype": "float32", "shape": [4, 6],
                     "nbytes": 96, "file": None}  # fmt: skip
    result = cli("get", "doc/1", str(tmp_path / "out.npy"), "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["file"] == str(tmp_path / "out.npy")
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
    result = cli("stats")  # piped: name<TAB>value, raw numbers
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == "name\tvalue" and all(line.count("\t") == 1 for line in lines)
    assert f"host.capacity_bytes\t{64 * 1024**2}" in lines
    body = json.loads(cli("stats", "--json").stdout)
    assert body["entries_ready"] >= 1 and body["host"]["capacity_bytes"] == 64 * 1024**2
    text = _on_terminal(stats_table(body), 80)
    assert "host pool" in text and "64.0 MiB" in text

    result = cli("ls", "--sort", "size")  # not a terminal: a header, one record a line
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0] == "\t".join(LS_COLUMNS)
    assert "stats-key\tready\tfloat32\t64x1024\t262144\t" in result.stdout
    page = json.loads(cli("ls", "--json", "--sort", "size", "--limit", "1").output)
    assert page["items"][0]["key"] == "stats-key"
    assert cli("ls", "--state", "bogus").exit_code == 2  # checked here, as typer does


def test_evict(cli: Any, tmp_path: Path) -> None:
    np.save(tmp_path / "e.npy", np.ones((8, 8), dtype=np.float32))
    for key in ("ev/1", "ev/2"):
        assert cli("put", str(tmp_path / "e.npy"), key).exit_code == 0
    result = cli("evict", "ev/1", "ev/missing")  # piped: key<TAB>result; the total on stderr
    assert result.exit_code == 1
    assert result.stdout == "key\tresult\nev/1\tevicted\nev/missing\tnot_found\n"
    assert "freed 1 entry," in result.stderr
    result = cli("evict", "ev/2", "--json")
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    assert body["evicted"] == ["ev/2"] and body["freed_entries"] == 1
    result = cli("evict", "--free", "1MiB")
    assert result.exit_code == 0 and "freed" in result.stderr
    assert cli("evict").exit_code == 2
    assert cli("evict", "--free", "lots").exit_code == 2
    result = cli("evict", "ev/1", "--device-pool", "0")  # no device pools here: 409
    assert result.exit_code == 1 and "409" in result.output, result.output
    assert cli("evict", "ev/1", "--device-pool", "-1").exit_code == 2


def _on_terminal(table: Any, width: int) -> str:
    """What a table looks like on a terminal ``width`` columns wide."""
    console = Console(width=width, force_terminal=True, color_system=None, record=True)
    with console.capture() as capture:
        console.print(table)
    return capture.get()


def test_ls_table_never_wraps_short_fields() -> None:
    long_key = "video/" + "k" * 120
    page = {"items": [{"key": key, "state": "ready", "dtype": "bfloat16", "shape": [4096, 4096],
                       "nbytes": 32 * 1024**2, "num_runs": 12, "leases": 3, "idle_s": 125.0,
                       "residency": ["host", "device:0"]} for key in (long_key, "k")],
            "total": 2, "offset": 0}  # fmt: skip
    for width in (80, 100):
        text = _on_terminal(entries_table(page, width), width)
        assert all(len(line) <= width for line in text.splitlines()), text
        assert text.count("bfloat16") == 2 and text.count("4096x4096") == 2, text
        assert text.count("32.0 MiB") == 2 and text.count("ready") == 2, text
        assert text.count("device:0") == 2, text
        assert "video/" in text and text.count("k") == 1 + 120 + 1  # "key", folded, "k"


def test_sessions_piped_json_and_on_a_terminal(cli: Any, daemon: dict[str, Any]) -> None:
    from embcache.clients import EmbCacheClient

    with EmbCacheClient(f"127.0.0.1:{daemon['grpc_port']}", token=TOKEN) as client:
        client.put("sess/1", torch.zeros(4))
        with client.get(["sess/1"]) as [tensor]:  # a get opens the session
            assert tensor.shape == (4,)
        result = cli("sessions")
        assert result.exit_code == 0, result.output
        lines = result.stdout.splitlines()
        assert lines[0] == "\t".join(SESSION_COLUMNS)
        rows = [line.split("\t") for line in lines[1:]]
        assert all(len(row) == len(SESSION_COLUMNS) for row in rows)
        mine = [row for row in rows if row[3] == str(os.getpid())]
        assert mine and mine[0][2].endswith(f":{os.getpid()}"), rows  # named by default
        body = json.loads(cli("sessions", "--json").stdout)
        assert any(s["pid"] == os.getpid() for s in body["sessions"])
        text = _on_terminal(sessions_table(body, 80), 80)
        assert all(len(line) <= 80 for line in text.splitlines())
        session = mine[0][0]
        result = cli("drop-session", session, "--json")
        assert result.exit_code == 0, result.output
        dropped = json.loads(result.stdout)
        assert dropped["session_id"] == session and dropped["leases_ended"] in (0, 1)
    one = {"sessions": [dict(body["sessions"][0])]}
    assert "1 session" in [
        line.strip() for line in _on_terminal(sessions_table(one, 80), 80).splitlines()
    ]


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
    assert result.exit_code == 0 and result.stdout.split() == ["script", "tiny"]
    assert json.loads(cli("bench", "--bench-dir", str(bench), "--list", "--json").stdout) == [
        "tiny"
    ]
    result = cli("bench", "--bench-dir", str(bench), "--json", "--", "--reps", "2")
    assert result.exit_code == 0, result.output
    [run] = json.loads(result.stdout)["results"]
    assert run["script"] == "tiny" and run["exit_code"] == 0
    assert "argv ['--reps', '2']" in run["stdout"]
    result = cli("bench", "--bench-dir", str(bench))
    assert result.exit_code == 0, result.output
    assert "| 1 KiB | 1.0 |" in result.output and f"port {daemon['http_port']}" in result.output
    result = cli("bench", "--bench-dir", str(bench), "--", "--reps", "2")
    assert result.exit_code == 0 and "argv ['--reps', '2']" in result.output
    (bench / "broken.py").write_text("raise SystemExit('boom')\n")
    result = cli("bench", "--bench-dir", str(bench), "--only", "broken")
    assert result.exit_code == 1 and "boom" in result.output
    result = cli("bench", "--bench-dir", str(tmp_path / "none"))
    assert result.exit_code == 2 and "no such folder" in result.stderr


def _console_script() -> list[str]:
    """The ``embcache`` command as installed beside this interpreter, else ``-m``."""
    script = Path(sys.executable).with_name("embcache")
    return [str(script)] if script.exists() else [sys.executable, "-m", "embcache.service.cli"]


def test_bench_finds_the_repository_bench_folder(tmp_path: Path) -> None:
    """``embcache bench --list`` as users run it, from any folder, lists bench/*.py."""
    import embcache

    repo = Path(embcache.__file__).resolve().parent
    wanted = sorted(p.stem for p in (repo / "bench").glob("*.py") if not p.stem.startswith("_"))
    out = subprocess.run([*_console_script(), "bench", "--list"], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["script", *wanted] and "engine" in wanted


def test_serve_subprocess_cli_stats(daemon: dict[str, Any]) -> None:
    """The installed entry point, end to end in its own process."""
    env = {**os.environ, "EMBCACHE_HTTP_PORT": str(daemon["http_port"]),
           "EMBCACHE_AUTH_TOKEN": TOKEN}  # fmt: skip
    cmd = [sys.executable, "-m", "embcache.service.cli", "stats", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60, check=True)
    assert json.loads(out.stdout)["host"]["tier"] == "host"
