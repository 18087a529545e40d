"""Shared fixtures. GPU tests are skipped where CUDA is absent."""

from __future__ import annotations

import os
import selectors
import time
import uuid

import pytest
import torch

# Without a GPU, Triton kernels run on CPU tensors in the interpreter; this must precede any
# @triton.jit. With a GPU they compile for real (an explicit TRITON_INTERPRET always wins).
if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def shm_name() -> str:
    """A shared-memory segment name no other test uses."""
    return f"embcache-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def serve_command(*flags: str) -> list[str]:
    """``embcache serve`` from this interpreter on ephemeral ports, plus ``flags``."""
    import sys

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
        *flags,
    ]


@pytest.fixture(name="serve_command")
def serve_command_fixture():  # type: ignore[no-untyped-def]
    return serve_command


class DaemonProcess:
    """``embcache serve`` in a subprocess, with the JSON ready line it printed."""

    def __init__(self, flags: list[str], env: dict[str, str] | None = None) -> None:
        import json
        import subprocess

        cmd = serve_command(*flags)
        if not any(f == "--shm-name" for f in flags):
            cmd += ["--shm-name", f"embcache-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})}
        )
        assert self.proc.stdout is not None
        line = ""
        deadline = time.monotonic() + 120  # bounded: a daemon that never gets ready fails
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while not line and time.monotonic() < deadline and self.proc.poll() is None:
                if sel.select(timeout=0.5):
                    line = self.proc.stdout.readline()
        if not line:
            self.stop(timeout=10)
            raise RuntimeError(f"daemon not ready (exit code {self.proc.returncode})")
        self.ready: dict = json.loads(line)
        self.grpc_target = f"127.0.0.1:{self.ready['grpc_port']}"
        self.http_url = f"http://127.0.0.1:{self.ready['http_port']}"

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM (drain) and wait; kill if it hangs. Returns the exit code."""
        import signal
        import subprocess

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return code


@pytest.fixture
def start_daemon():  # type: ignore[no-untyped-def]
    """Start daemons with extra flags; every one still running is stopped at teardown."""
    started: list[DaemonProcess] = []

    def start(*flags: str, env: dict[str, str] | None = None) -> DaemonProcess:
        daemon = DaemonProcess(list(flags), env)
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.stop()
