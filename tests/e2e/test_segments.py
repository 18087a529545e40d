"""Who removes a shared-memory segment: a starting daemon removes those whose lock is free
(left by a daemon that stopped or died), whatever their age, and never a live daemon's;
no lock file is left anywhere."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from embcache.service.daemon_process import read_line, serve_command, stop
from embcache.service.host.host_pool import (
    INDEX_SUFFIXES,
    SHM_DIR,
    HostPool,
    PoolInUseError,
    remove_stale_segments,
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start(port: int, log: Path, *flags: str) -> tuple[subprocess.Popen[str], str]:
    """A daemon on gRPC ``port`` with no --shm-name (named ``embcache-<port>-<random>``),
    its log in the file ``log``."""
    cmd = serve_command("--host-pool-bytes", "16MiB", *flags)
    cmd[cmd.index("--grpc-port") + 1] = str(port)
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBCACHE_")}
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    try:
        ready = json.loads(read_line(proc, '"ready"', 120))
    except BaseException:
        stop(proc, timeout=10, sig=signal.SIGKILL)
        raise
    return proc, str(ready["shm_name"])


def leftovers(prefix: str) -> list[str]:
    return sorted(p.name for p in SHM_DIR.iterdir() if prefix in p.name)


def test_quick_restart_with_warm_restart_off_leaves_no_segment(tmp_path: Path) -> None:
    port = free_port()
    prefix = f"embcache-{port}"
    first, kept = start(port, tmp_path / "first.log", "--warm-restart", "on")
    assert stop(first, timeout=30) == 0
    assert (SHM_DIR / kept).exists()  # a clean stop keeps it for a warm restart
    second, own = start(port, tmp_path / "second.log", "--warm-restart", "off")  # seconds later
    try:
        assert not (SHM_DIR / kept).exists(), "the segment a stopped daemon kept was left"
        assert [n for n in leftovers(prefix) if not n.endswith(INDEX_SUFFIXES)] == [own]
    finally:
        assert stop(second, timeout=30) == 0
    log = (tmp_path / "second.log").read_text()
    assert f"removing shared-memory segment {kept}, left with its index by a daemon that " \
           "stopped" in log, log  # fmt: skip
    assert "dead daemon" not in log
    assert leftovers(prefix) == []  # warm restart off: SIGTERM removed its own


def test_a_live_daemons_segment_is_never_removed(tmp_path: Path) -> None:
    port = free_port()
    prefix = f"embcache-{port}"
    live, name = start(port, tmp_path / "live.log", "--warm-restart", "off")
    try:
        assert remove_stale_segments(prefix) == 0
        with pytest.raises(PoolInUseError, match="belongs to a running daemon"):
            HostPool(name, 1 << 20, 1 << 16)
        assert (SHM_DIR / name).exists()
        assert live.poll() is None
    finally:
        assert stop(live, timeout=30) == 0
    assert leftovers(prefix) == []


def test_a_dead_daemons_segment_is_removed_by_the_next_start(tmp_path: Path) -> None:
    port = free_port()
    prefix = f"embcache-{port}"
    dead, name = start(port, tmp_path / "dead.log", "--warm-restart", "off")
    stop(dead, timeout=30, sig=signal.SIGKILL)  # no clean-up: its segment stays, unlocked
    assert (SHM_DIR / name).exists()
    second, _ = start(port, tmp_path / "next.log", "--warm-restart", "off")
    try:
        assert not (SHM_DIR / name).exists()
    finally:
        assert stop(second, timeout=30) == 0
    assert "left by a daemon that did not stop cleanly" in (tmp_path / "next.log").read_text()
    for path in SHM_DIR.glob(f"{name}*"):  # its index or read table, if any
        path.unlink()
    assert leftovers(prefix) == []


def test_no_lock_file_is_left_behind(tmp_path: Path) -> None:
    before = set(Path("/tmp").glob("embcache*.lock"))
    pool = HostPool(f"embcache-locks-{os.getpid()}", 1 << 20, 1 << 16)
    try:
        assert not [p for p in SHM_DIR.iterdir() if p.name.startswith(f".{pool.name}")]
    finally:
        pool.close()
    assert set(Path("/tmp").glob("embcache*.lock")) <= before
    assert not (SHM_DIR / pool.name).exists()
