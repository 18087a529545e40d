"""The daemon process: ready line, systemd notifications, socket and segment modes, drain."""

from __future__ import annotations

import signal
import socket
import stat
import subprocess
import uuid
from pathlib import Path

import pytest

from embcache.service.host.host_pool import SHM_DIR


def test_notify_modes_and_drain(tmp_path: Path, start_daemon) -> None:  # type: ignore[no-untyped-def]
    notify = tmp_path / "notify.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(notify))
    listener.settimeout(60)
    name = f"embcache-daemon-{uuid.uuid4().hex[:8]}"
    grpc_sock = tmp_path / "d.sock"
    try:
        daemon = start_daemon(
            "--grpc-socket",
            str(grpc_sock),
            "--shm-name",
            name,
            "--host-pool-bytes",
            "16MiB",
            "--shm-mode",
            "0640",
            "--socket-mode",
            "0600",
            env={"NOTIFY_SOCKET": str(notify)},
        )
        assert daemon.ready["event"] == "ready" and daemon.ready["shm_name"] == name
        assert listener.recv(100) == b"READY=1"
        assert stat.S_IMODE((SHM_DIR / name).stat().st_mode) == 0o640
        assert stat.S_IMODE(grpc_sock.stat().st_mode) == 0o600
        daemon.proc.send_signal(signal.SIGTERM)
        assert listener.recv(100) == b"STOPPING=1"
        assert daemon.stop() == 0
    finally:
        listener.close()
    assert not (SHM_DIR / name).exists(), "the segment must be removed on exit"


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (["--grpc-host", "0.0.0.0"], "--auth-token"),
        (["--shm-mode", "0777"], "--shm-mode"),
        (["--page-bytes", "1000"], "--page-bytes"),
    ],
)
def test_bad_settings_refuse_to_start(flags: list[str], field: str, serve_command) -> None:  # type: ignore[no-untyped-def]
    out = subprocess.run(serve_command(*flags), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert field in out.stderr


def test_second_daemon_on_the_same_segment_fails(start_daemon, serve_command) -> None:  # type: ignore[no-untyped-def]
    name = f"embcache-daemon-{uuid.uuid4().hex[:8]}"
    flags = ("--shm-name", name, "--host-pool-bytes", "16MiB")
    first = start_daemon(*flags)
    second = subprocess.run(serve_command(*flags), capture_output=True, text=True, timeout=60)
    assert second.returncode == 1
    assert "belongs to a running daemon" in second.stderr
    assert (SHM_DIR / name).exists()  # the first daemon's segment is untouched
    assert first.stop() == 0
