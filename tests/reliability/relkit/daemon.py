"""``embcache serve`` as a subprocess: start (ready line), REST stats, stop, kill, restart."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

from embcache.service.daemon_process import serve_command

SHM_DIR = Path("/dev/shm")


def clean_env() -> dict[str, str]:
    """The environment without EMBCACHE_* settings (each run says what it wants)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("EMBCACHE_")}


@dataclass
class DaemonSpec:
    """How to start a daemon. ``extra`` are more ``serve`` flags."""

    workdir: Path
    pool: str = "64MiB"
    lease_ttl_s: float = 3.0
    shm_name: str = field(default_factory=lambda: f"embcache-rel-{uuid.uuid4().hex[:12]}")
    socket_name: str = "d.sock"
    drain_grace_s: float = 2.0
    extra: tuple[str, ...] = ()
    token: str | None = None
    device: str = "cpu"  # "auto"/"cuda" for GPU runs
    env: dict[str, str] = field(default_factory=dict)  # EMBCACHE_* settings, say
    warm_restart: bool = False  # on: SIGTERM leaves the segment for the next start

    def args(self) -> list[str]:
        args = serve_command(
            "--grpc-socket",
            str(self.workdir / self.socket_name),
            "--shm-name",
            self.shm_name,
            "--host-pool-bytes",
            self.pool,
            "--lease-ttl-s",
            str(self.lease_ttl_s),
            "--drain-grace-s",
            str(self.drain_grace_s),
            "--device",
            self.device,
            "--warm-restart",
            "on" if self.warm_restart else "off",
            *self.extra,
        )
        if self.token:
            args += ["--auth-token", self.token]
        return args


@dataclass
class Daemon:
    spec: DaemonSpec
    proc: subprocess.Popen[str]
    ready: dict[str, Any]
    log_path: Path
    started_s: float  # seconds from spawn to the ready line

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def tcp(self) -> str:
        return f"127.0.0.1:{self.ready['grpc_port']}"

    @property
    def unix(self) -> str:
        return f"unix:{self.ready['grpc_socket']}"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.ready['http_port']}"

    @property
    def shm_path(self) -> Path:
        return SHM_DIR / self.ready["shm_name"]

    @property
    def socket_path(self) -> Path:
        return Path(self.ready["grpc_socket"])

    def spec_shm_path(self) -> Path:
        return SHM_DIR / self.spec.shm_name

    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.spec.token}"} if self.spec.token else {}

    def rest(self, path: str, method: str = "GET", timeout: float = 10.0, **kw: Any) -> Any:
        reply = httpx.request(
            method, self.http + path, headers=self.headers(), timeout=timeout, **kw
        )
        reply.raise_for_status()
        return reply.json()

    def stats(self) -> dict[str, Any]:
        return self.rest("/v1/stats")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, nbytes: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-nbytes:]
        except OSError:
            return ""


def start(spec: DaemonSpec, timeout: float = 90.0) -> Daemon:
    """Spawn ``embcache serve`` and wait for its ready line (stderr goes to a log file)."""
    spec.workdir.mkdir(parents=True, exist_ok=True)
    log_path = spec.workdir / f"{spec.shm_name}-{uuid.uuid4().hex[:6]}.log"
    t0 = time.monotonic()
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            spec.args(), stdout=subprocess.PIPE, stderr=log, text=True, env=clean_env() | spec.env
        )
    try:
        ready = read_json_line(proc.stdout, proc, "ready", timeout)
    except BaseException:
        reap(proc)
        raise AssertionError(
            f"daemon not ready (exit {proc.returncode}): {log_path.read_text()[-2000:]}"
        ) from None
    return Daemon(spec, proc, ready, log_path, time.monotonic() - t0)


@contextlib.contextmanager
def running(spec: DaemonSpec) -> Iterator[Daemon]:
    """A daemon started for the block, stopped (drained) after it."""
    d = start(spec)
    try:
        yield d
    finally:
        stop(d)


def read_json_line(
    stream: IO[str] | None, proc: subprocess.Popen[Any], event: str, timeout: float
) -> dict[str, Any]:
    """The first JSON line on ``stream`` whose ``event`` is ``event`` (bounded wait)."""
    assert stream is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([stream], [], [], 0.2)[0]:
            line = stream.readline()
            if not line:
                break
            if line.startswith("{"):
                msg = json.loads(line)
                if msg.get("event") == event:
                    return msg
        elif proc.poll() is not None:
            break
    raise TimeoutError(f"no {event!r} line from pid {proc.pid} (exit {proc.poll()})")


def stop(daemon: Daemon, timeout: float = 30.0) -> int:
    """SIGTERM (drain) and wait; returns the exit code. Kills by pid if it hangs."""
    if daemon.alive():
        daemon.proc.send_signal(signal.SIGTERM)
    try:
        return daemon.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        reap(daemon.proc)
        raise AssertionError(f"daemon pid {daemon.pid} ignored SIGTERM for {timeout}s") from None
    finally:
        reap(daemon.proc)


def discard(daemon: Daemon) -> None:
    """Kill a daemon started here if it still runs, then remove what a killed daemon leaves
    (its segment name and socket path are unique to this run)."""
    reap(daemon.proc)
    daemon.spec_shm_path().unlink(missing_ok=True)
    for suffix in (".index", ".index.tmp", ".reads"):  # the files beside it
        SHM_DIR.joinpath(daemon.spec.shm_name + suffix).unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        if daemon.socket_path.is_socket():
            daemon.socket_path.unlink()


def reap(proc: subprocess.Popen[Any]) -> None:
    """Kill a process started here (by its pid) if it still runs, wait, close its pipes."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()


def wait_for(pred: Callable[[], bool], timeout: float, period: float = 0.05) -> float | None:
    """Seconds until ``pred()`` held, or None if it did not within ``timeout``."""
    t0 = time.monotonic()
    while True:
        if pred():
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            return None
        time.sleep(period)


def quiescent(stats: dict[str, Any], leases: int = 0) -> bool:
    """No lease beyond ``leases``, nothing filling, nothing reserved."""
    return (
        stats["leases_active"] <= leases
        and stats["entries_filling"] == 0
        and stats["reserved_filling_bytes"] == 0
    )
