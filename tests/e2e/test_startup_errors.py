"""``embcache serve`` that cannot start: one line on stderr naming what to change, exit 1
(2 for settings that fail validation), and nothing left behind (no segment, no socket)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from embcache.service.daemon_process import serve_command
from embcache.service.host.host_pool import SHM_DIR

TEXT_REFUSAL = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ERROR embcache: cannot start: ")


def refused(*flags: str, code: int = 1, env: dict[str, str] | None = None) -> str:
    """Run ``embcache serve`` that must refuse to start; its one stderr line, in the one
    format of every refusal, without pydantic's words."""
    name = f"embcache-refused-{uuid.uuid4().hex[:8]}"
    cmd = serve_command("--host-pool-bytes", "16MiB", "--shm-name", name, *flags)
    for var in env or {}:  # a setting given by the environment: no flag for it
        flag = "--" + var.removeprefix("EMBCACHE_").lower().replace("_", "-")
        while flag in cmd:
            del cmd[cmd.index(flag) : cmd.index(flag) + 2]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("EMBCACHE_")}, **(env or {})}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == code, out.stderr
    assert len(lines) == 1, out.stderr
    assert "Traceback" not in out.stderr and "Event loop is closed" not in out.stderr
    assert not (SHM_DIR / name).exists(), "a refused start leaves no segment"
    assert "Value error" not in out.stderr and "validation error" not in out.stderr
    assert "--log-format" in flags or TEXT_REFUSAL.match(lines[0]), lines[0]
    return lines[0]


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    # Unix socket paths are limited to 107 bytes: pytest's tmp_path may be longer.
    import tempfile

    with tempfile.TemporaryDirectory(prefix="ecs-") as d:
        yield Path(d)


def test_busy_grpc_port(busy_port: int) -> None:
    line = refused("--grpc-port", str(busy_port))
    assert f"gRPC port 127.0.0.1:{busy_port} is in use" in line and "--grpc-port" in line


def test_busy_port_from_the_environment_names_the_variable(busy_port: int) -> None:
    line = refused(env={"EMBCACHE_GRPC_PORT": str(busy_port)}, code=1)
    assert f"cannot start: EMBCACHE_GRPC_PORT={busy_port} (--grpc-port): gRPC port" in line


@pytest.mark.parametrize(
    ("flags", "env", "expected"),
    [
        (["--host-pool-bytes", "0"], {}, "cannot start: --host-pool-bytes 0: must be positive"),
        ([], {"EMBCACHE_PAGE_BYTES": "3000"},
         "cannot start: EMBCACHE_PAGE_BYTES=3000 (--page-bytes): must be a power of two"),
        (["--warm-restart", "maybe"], {}, "cannot start: --warm-restart maybe: must be on or off"),
        (["--grpc-port", "x"], {}, "cannot start: --grpc-port x: must be a whole number"),
        (["--ipc-mode", "tcp"], {}, "cannot start: --ipc-mode tcp: must be 'fd' or 'legacy'"),
        ([], {"EMBCACHE_GRPC_HOST": "0.0.0.0"},
         "cannot start: EMBCACHE_GRPC_HOST=0.0.0.0 (--grpc-host): non-loopback bind "
         "(--grpc-host 0.0.0.0) needs --auth-token, or mTLS (--tls-cert, --tls-key and "
         "--tls-client-ca)"),
        (["--auth-token", "two words"], {},
         "cannot start: --auth-token <hidden>: holds spaces"),
    ],
)  # fmt: skip
def test_settings_refusals_name_the_flag_or_variable(
    flags: list[str], env: dict[str, str], expected: str
) -> None:
    line = refused(*flags, env=env, code=2)
    assert expected in line, line
    assert "two words" not in line  # a token is never echoed


def test_settings_refusal_in_json_log_format() -> None:
    line = refused("--log-format", "json", "--host-pool-bytes", "-1", code=2)
    record = json.loads(line)
    assert record["level"] == "error" and record["logger"] == "embcache"
    assert record["message"].startswith("cannot start: --host-pool-bytes -1: ")


def test_busy_http_port(busy_port: int) -> None:
    line = refused("--http-port", str(busy_port))
    assert f"HTTP port 127.0.0.1:{busy_port} is in use" in line and "--http-port" in line


def test_foreign_address() -> None:
    line = refused("--http-host", "192.0.2.1", "--auth-token", "t")  # TEST-NET-1: never ours
    assert "192.0.2.1" in line and "--http-host" in line


def test_json_log_format_keeps_the_one_line(busy_port: int) -> None:
    line = refused("--grpc-port", str(busy_port), "--log-format", "json")
    record = json.loads(line)
    assert record["level"] == "error"
    assert record["message"].startswith(f"cannot start: --grpc-port {busy_port}: gRPC port")


def test_grpc_socket_paths(sock_dir: Path) -> None:
    plain = sock_dir / "file.sock"
    plain.write_text("not a socket")
    assert "--grpc-socket" in (line := refused("--grpc-socket", str(plain)))
    assert "exists and is not a socket" in line
    long = sock_dir / ("x" * 120)
    assert "longer than a Unix socket path may be" in refused("--grpc-socket", str(long))
    with socket.socket(socket.AF_UNIX) as live:
        live.bind(str(sock_dir / "live.sock"))
        live.listen()
        line = refused("--grpc-socket", str(sock_dir / "live.sock"))
    assert "another process listens there" in line
    assert plain.read_text() == "not a socket"  # refused, never replaced


def test_fd_socket_path() -> None:
    line = refused("--ipc-socket", "/proc/embcache-nowhere/pools.fds")
    assert "--ipc-socket" in line and "cannot create its directory" in line


def test_shared_memory_segment_without_room() -> None:
    line = refused("--host-pool-bytes", "64TiB")
    assert "no room for a 64.0 TiB host pool in /dev/shm" in line
    assert "--host-pool-bytes" in line


def test_tls_files(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    line = refused("--tls-cert", str(cert), "--tls-key", str(key))
    assert line.endswith(f"--tls-cert {cert}: no such file")
    cert.write_text("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
    key.mkdir()
    assert "--tls-key" in (line := refused("--tls-cert", str(cert), "--tls-key", str(key)))
    assert "is a directory" in line
    key.rmdir()
    key.write_text("garbage")
    line = refused("--tls-cert", str(cert), "--tls-key", str(key))
    assert "not a PEM certificate and its private key" in line


@pytest.mark.skipif(os.getuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_tls_key(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_text("x")
    key.write_text("x")
    key.chmod(0)
    line = refused("--tls-cert", str(cert), "--tls-key", str(key))
    assert "--tls-key" in line and "not readable" in line


@pytest.mark.parametrize(
    ("flags", "flag"),
    [
        (["--auth-token", "secret\n"], "--auth-token"),
        (["--auth-token", "two words"], "--auth-token"),
        (["--shm-name", "a/b"], "--shm-name"),
    ],
)
def test_bad_token_or_segment_name_is_a_settings_error(flags: list[str], flag: str) -> None:
    out = subprocess.run(serve_command(*flags), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and flag in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
