"""The operator commands as a newcomer meets them: their own flags only, one --target for
both planes, clear messages when the target, the daemon or the file is wrong, and output
that pipes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file
from typer.testing import CliRunner

from embcache import build_info
from embcache.service.cli import app
from embcache.service.config import DEPRECATED_NAMES, Settings
from embcache.service.daemon_process import DaemonProcess

TOKEN = "target-token"
OPERATOR_COMMANDS = ("stats", "ls", "evict", "put", "get", "bench")


@pytest.fixture(scope="module")
def daemon() -> Iterator[dict[str, Any]]:
    flags = ["--host-pool-bytes", "16MiB", "--page-bytes", "64KiB", "--device", "cpu"]
    child = DaemonProcess([*flags, "--auth-token", TOKEN], timeout=60)
    try:
        yield child.ready
    finally:
        child.stop(timeout=15)


def run(*args: str, env: dict[str, str] | None = None) -> Any:
    clean = {k: "" for k in os.environ if k.startswith("EMBCACHE_")}
    return CliRunner().invoke(app, list(args), env={**clean, "COLUMNS": "100", **(env or {})})


def test_version() -> None:
    result = run("--version")
    assert result.exit_code == 0 and result.output.strip() == f"embcache {build_info.describe()}"


@pytest.mark.parametrize("command", OPERATOR_COMMANDS)
def test_operator_help_shows_only_its_own_flags(command: str) -> None:
    text = run(command, "--help").output
    assert "--target" in text and "EMBCACHE_TARGET" in text and "--token" in text
    assert "--host-pool-bytes" not in text and "--grpc-port" not in text
    assert text.count("--") < 25, text


def test_operator_flags_have_real_types_and_defaults() -> None:
    text = run("ls", "--help").output
    assert "ready|filling|leased" in text and "1<=x<=1000" in text and "default: 50" in text


def test_serve_help_keeps_every_setting_and_hides_old_names() -> None:
    text = " ".join(run("serve", "--help", env={"COLUMNS": "250"}).output.split())
    for name in Settings.model_fields:
        assert "--" + name.replace("_", "-") in text, name
    for old in DEPRECATED_NAMES:
        assert "--" + old.replace("_", "-") + " " not in text, old


@pytest.mark.parametrize("form", ["{host}:{port}", "http://{host}:{port}"])
def test_one_target_reaches_both_planes(daemon: dict, tmp_path: Path, form: str) -> None:
    target = form.format(host="127.0.0.1", port=daemon["http_port"])
    env = {"EMBCACHE_TARGET": target, "EMBCACHE_AUTH_TOKEN": TOKEN}
    np.save(tmp_path / "a.npy", np.arange(6, dtype=np.float32))
    assert run("put", str(tmp_path / "a.npy"), "t/1", env=env).exit_code == 0  # gRPC
    got = run("get", "t/1", str(tmp_path / "b.npy"), env=env)
    assert got.exit_code == 0, got.output
    assert np.array_equal(np.load(tmp_path / "b.npy"), np.arange(6, dtype=np.float32))
    stats = run("stats", "--target", target, "--token", TOKEN)  # REST, flags instead of env
    assert stats.exit_code == 0 and build_info.version() in stats.output


def test_stats_at_the_grpc_port_says_so(daemon: dict) -> None:
    result = run("stats", "--target", f"127.0.0.1:{daemon['grpc_port']}", "--token", TOKEN)
    assert result.exit_code == 1
    assert "gRPC port" in result.output and "illegal request line" not in result.output


def test_put_with_the_daemon_down_fails_fast(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    np.save(tmp_path / "a.npy", np.zeros(4, dtype=np.float32))
    started = time.monotonic()
    result = run("put", str(tmp_path / "a.npy"), "k", "--target", f"127.0.0.1:{port}")
    assert time.monotonic() - started < 3
    assert result.exit_code == 1
    assert f"cannot reach the daemon at http://127.0.0.1:{port} (connection refused)" in (
        result.output
    )
    assert "StatusCode" not in result.output and "Traceback" not in result.output


def test_put_of_files_that_hold_no_tensor(tmp_path: Path) -> None:
    (tmp_path / "junk.npy").write_bytes(b"not an array")
    (tmp_path / "junk.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    for name, words in (("junk.npy", "not a .npy array file"),
                        ("junk.safetensors", "not a .safetensors file")):  # fmt: skip
        result = run("put", str(tmp_path / name), "k")
        assert result.exit_code == 2 and words in result.output, result.output
    save_file({"a": np.zeros(2, dtype=np.float32)}, str(tmp_path / "one.safetensors"))
    result = run("put", str(tmp_path / "one.safetensors"), "k", "--tensor", "b")
    assert result.exit_code == 2 and "has no tensor 'b'; it holds ['a']" in result.output


def test_ls_piped_is_one_record_a_line(daemon: dict, tmp_path: Path) -> None:
    env = {"EMBCACHE_TARGET": f"127.0.0.1:{daemon['http_port']}", "EMBCACHE_AUTH_TOKEN": TOKEN}
    long_key = "video/" + "x" * 300
    np.save(tmp_path / "a.npy", np.zeros(4, dtype=np.float32))
    assert run("put", str(tmp_path / "a.npy"), long_key, env=env).exit_code == 0
    cmd = [sys.executable, "-m", "embcache.service.cli", "ls", "--sort", "size"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True,
                         env={**os.environ, **env, "COLUMNS": "80"})  # fmt: skip
    lines = out.stdout.splitlines()
    record = next(line for line in lines if line.startswith(long_key))
    assert record.split("\t")[1:5] == ["ready", "float32", "4", "16"]
    assert all(len(line.split("\t")) == 9 for line in lines)


def test_local_and_server_side_flag_errors_read_alike(daemon: dict) -> None:
    env = {"EMBCACHE_TARGET": f"127.0.0.1:{daemon['http_port']}", "EMBCACHE_AUTH_TOKEN": TOKEN}
    local = run("ls", "--limit", "0", env=env)
    server = run("ls", "--offset", str(2**63), env=env)  # past what the API accepts
    for result, flag in ((local, "--limit"), (server, "--offset")):
        assert result.exit_code == 2, result.output
        assert f"Invalid value for '{flag}'" in " ".join(result.output.split())
    bad = run("evict", "--free", "lots", env=env)
    assert bad.exit_code == 2 and "Invalid value for '--free'" in bad.output
