"""Shared fixtures. GPU tests are skipped where CUDA is absent."""

from __future__ import annotations

import os
import uuid

import pytest
import torch

from embcache.service.daemon_process import DaemonProcess, serve_command

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


@pytest.fixture(name="serve_command")
def serve_command_fixture():  # type: ignore[no-untyped-def]
    return serve_command


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
