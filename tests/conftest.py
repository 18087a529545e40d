"""Shared fixtures. GPU tests are skipped where CUDA is absent."""

from __future__ import annotations

import os
import uuid

import pytest

# Triton kernels run on CPU tensors in the interpreter; this must precede any @triton.jit.
os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch missing entirely
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def shm_name() -> str:
    """A shared-memory segment name no other test uses."""
    return f"embcache-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
