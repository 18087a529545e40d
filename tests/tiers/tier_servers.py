"""Launchers for the real stores the shared-tier tests use, all bound to 127.0.0.1.

- ``RedisNodes``: Debian ``redis-server`` processes (``--bind 127.0.0.1``, no persistence,
  ``protected-mode``), optionally joined into a cluster with ``redis-cli --cluster create``.
- ``MooncakeMaster``: the package's ``mooncake_master`` with its RPC and metrics/admin
  listeners on 127.0.0.1 (``--metrics_host`` defaults to 0.0.0.0, so it is always passed),
  no HTTP metadata server, no KV-event publisher.

Processes are stopped by the pid this module started, never by name; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

LOOPBACK = "127.0.0.1"


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def free_ports(n: int, *, bus_offset: int = 0) -> list[int]:
    """``n`` free loopback ports (with ``bus_offset``: port + offset free too, for the
    Redis cluster bus)."""
    ports: list[int] = []
    for _ in range(200):
        with socket.socket() as s:
            s.bind((LOOPBACK, 0))
            port = s.getsockname()[1]
        if port in ports or (bus_offset and (port + bus_offset > 65535)):
            continue
        if bus_offset and not port_free(port + bus_offset):
            continue
        ports.append(port)
        if len(ports) == n:
            return ports
    raise RuntimeError("no free loopback ports")


def wait_port(port: int, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before listening")
        with contextlib.suppress(OSError), socket.create_connection((LOOPBACK, port), 0.2):
            return
        time.sleep(0.02)
    raise TimeoutError(f"nothing listening on {LOOPBACK}:{port} after {timeout_s}s")


def stop(proc: subprocess.Popen[bytes] | None, sig: int = signal.SIGTERM) -> None:
    """Stop one process we started (by its pid), escalating to SIGKILL after 5 s."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


def redis_missing() -> str | None:
    """Why the Redis tests cannot run here, or None."""
    for tool in ("redis-server", "redis-cli"):
        if shutil.which(tool) is None:
            return f"{tool} not installed (Debian package redis-server)"
    try:
        import redis  # noqa: F401
    except ImportError:
        return "redis-py not installed (pip install -e '.[shared-tier]')"
    return None


class RedisNodes:
    """``n`` redis-server processes on loopback; ``cluster=True`` joins them (no replicas)."""

    def __init__(self, workdir: Path, n: int, *, cluster: bool) -> None:
        self.workdir = workdir
        self.cluster = cluster
        self.ports = free_ports(n, bus_offset=10000 if cluster else 0)
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    def _args(self, port: int) -> list[str]:
        args = [
            "redis-server",
            "--port", str(port),
            "--bind", LOOPBACK,
            "--protected-mode", "yes",
            "--dir", str(self.workdir),
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--logfile", str(self.workdir / f"redis-{port}.log"),
        ]  # fmt: skip
        if self.cluster:
            args += [
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(self.workdir / f"nodes-{port}.conf"),
                "--cluster-node-timeout", "1000",
            ]  # fmt: skip
        return args

    def start_node(self, port: int) -> None:
        proc = subprocess.Popen(
            self._args(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self.procs[port] = proc
        wait_port(port, 10, proc)

    def start(self) -> RedisNodes:
        for port in self.ports:
            self.start_node(port)
        if self.cluster:
            subprocess.run(
                ["redis-cli", "--cluster", "create"]
                + [f"{LOOPBACK}:{p}" for p in self.ports]
                + ["--cluster-replicas", "0", "--cluster-yes"],
                check=True,
                capture_output=True,
                timeout=30,
            )
            self.wait_cluster_ok(20)
        return self

    def cli(self, port: int, *args: str) -> str:
        out = subprocess.run(
            ["redis-cli", "-h", LOOPBACK, "-p", str(port), *args],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout

    def wait_cluster_ok(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            states = [self.cli(p, "cluster", "info") for p in self.ports if self.alive(p)]
            if states and all("cluster_state:ok" in s for s in states):
                return
            time.sleep(0.1)
        raise TimeoutError("redis cluster did not reach cluster_state:ok")

    def alive(self, port: int) -> bool:
        proc = self.procs.get(port)
        return proc is not None and proc.poll() is None

    def kill(self, port: int) -> None:
        stop(self.procs.get(port), signal.SIGKILL)

    def url(self, query: str = "") -> str:
        hosts = ",".join(f"{LOOPBACK}:{p}" for p in self.ports)
        return f"redis://{hosts}" + (f"?{query}" if query else "")

    def close(self) -> None:
        for proc in self.procs.values():
            stop(proc)


def mooncake_master_binary() -> Path | None:
    try:
        import mooncake
    except ImportError:
        return None
    path = Path(mooncake.__file__).parent / "mooncake_master"
    return path if path.exists() else None


class MooncakeMaster:
    def __init__(self, workdir: Path, port: int | None = None) -> None:
        binary = mooncake_master_binary()
        assert binary is not None, "mooncake package not installed"
        if not os.access(binary, os.X_OK):
            binary.chmod(binary.stat().st_mode | 0o111)
        self.binary = binary
        self.workdir = workdir
        self.port, self.metrics_port = (port, free_ports(1)[0]) if port else free_ports(2)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> MooncakeMaster:
        log = open(self.workdir / "mooncake-master.log", "ab")  # noqa: SIM115 (child owns it)
        self.proc = subprocess.Popen(
            [
                str(self.binary),
                f"--rpc_address={LOOPBACK}",
                f"--rpc_port={self.port}",
                f"--metrics_host={LOOPBACK}",  # default 0.0.0.0
                f"--metrics_port={self.metrics_port}",
                f"--http_metadata_server_host={LOOPBACK}",  # unused (disabled) but not 0.0.0.0
                "--enable_http_metadata_server=false",
                "--enable_kv_events=false",
                "--default_kv_lease_ttl=100",  # ms: lets tests remove objects they just read
                "--client_ttl=3",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.workdir,
        )
        log.close()
        wait_port(self.port, 10, self.proc)
        return self

    def kill(self) -> None:
        stop(self.proc, signal.SIGKILL)

    def close(self) -> None:
        stop(self.proc)


def start_storage_node(
    workdir: Path, master_port: int, segment_bytes: int
) -> subprocess.Popen[bytes]:
    """A Mooncake store client that lends ``segment_bytes`` of memory to the store."""
    script = Path(__file__).with_name("mooncake_storage_node.py")
    log = open(workdir / "mooncake-storage.log", "ab")  # noqa: SIM115 (child owns it)
    proc = subprocess.Popen(
        [sys.executable, str(script), f"{LOOPBACK}:{master_port}", str(segment_bytes)],
        stdout=subprocess.PIPE,
        stderr=log,
        cwd=workdir,
    )
    log.close()
    assert proc.stdout is not None
    line = proc.stdout.readline().decode().strip()  # "ready" once mounted
    if line != "ready":
        stop(proc)
        raise RuntimeError(f"mooncake storage node failed to start: {line!r}")
    return proc
