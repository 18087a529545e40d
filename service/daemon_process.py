"""``embcache serve`` as a child process, for tests and benchmarks: start it on ephemeral
ports, read the JSON ready line it prints, stop it by its pid (SIGTERM drains; SIGKILL
if it hangs)."""

from __future__ import annotations

import ctypes
import json
import os
import selectors
import signal
import subprocess
import sys
import time
import uuid
from typing import Any

PR_SET_PDEATHSIG = 1  # prctl option: the signal a child gets when its parent exits


def _die_with_parent() -> Any:
    """A ``preexec_fn`` that asks Linux to SIGTERM the child when the process that started
    it exits (a killed test run then leaves no daemon behind); ``None`` elsewhere. The libc
    call is looked up here, before the fork, so the child only makes the system call."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)

    return preexec


def serve_command(*flags: str) -> list[str]:
    """``embcache serve`` from this interpreter on ephemeral ports, without warm restart
    (a test's segment name is used once: SIGTERM removes it), plus ``flags`` (a flag given
    again in ``flags`` overrides the default here)."""
    return [
        sys.executable,
        "-m",
        "embcache.service.cli",
        "serve",
        "--grpc-port",
        "0",
        "--http-port",
        "0",
        "--log-level",
        "warning",
        "--warm-restart",
        "off",
        *flags,
    ]


def read_line(proc: subprocess.Popen[str], want: str, timeout: float) -> str:
    """The first line of ``proc``'s stdout containing ``want``; AssertionError if none comes
    within ``timeout`` seconds or the process exits first."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if sel.select(timeout=0.5):
                line = proc.stdout.readline()
                if not line:
                    break
                if want in line:
                    return line
            elif proc.poll() is not None:
                break
    raise AssertionError(f"no {want!r} from pid {proc.pid} (exit code {proc.poll()})")


def stop(proc: subprocess.Popen[str], timeout: float = 60, sig: int = signal.SIGTERM) -> int:
    """Send ``sig`` to a process started here and wait; SIGKILL if it outlives ``timeout``.
    Closes its pipes; returns the exit code."""
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait(timeout=10)
    for pipe in (proc.stdout, proc.stdin):
        if pipe is not None:
            pipe.close()
    return code


class DaemonProcess:
    """A started daemon and the ready line it printed (``ready``: ports, socket, pools).
    The child gets this process's environment without its ``EMBCACHE_*`` settings (flags
    decide), plus ``env``."""

    def __init__(
        self, flags: list[str], env: dict[str, str] | None = None, timeout: float = 120
    ) -> None:
        if "--shm-name" not in flags:  # a segment no other daemon uses
            flags = [*flags, "--shm-name", f"embcache-child-{os.getpid()}-{uuid.uuid4().hex[:8]}"]
        if "--warm-restart" not in flags:  # a name used once: keep nothing behind
            flags = [*flags, "--warm-restart", "off"]
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("EMBCACHE_")}
        self.proc = subprocess.Popen(
            serve_command(*flags),
            stdout=subprocess.PIPE,
            text=True,
            env={**inherited, **(env or {})},
            preexec_fn=_die_with_parent(),  # one system call in the child, no locks
        )
        try:
            self.ready: dict[str, Any] = json.loads(read_line(self.proc, '"ready"', timeout))
        except BaseException:
            stop(self.proc, timeout=10, sig=signal.SIGKILL)
            raise
        self.grpc_target = f"127.0.0.1:{self.ready['grpc_port']}"
        self.http_url = f"http://127.0.0.1:{self.ready['http_port']}"

    @property
    def unix_target(self) -> str:
        """The gRPC target of the Unix socket (``--grpc-socket``)."""
        return f"unix:{self.ready['grpc_socket']}"

    def stop(self, timeout: float = 60, sig: int = signal.SIGTERM) -> int:
        """SIGTERM (drain) and wait; SIGKILL if it hangs. Returns the exit code."""
        return stop(self.proc, timeout, sig)
