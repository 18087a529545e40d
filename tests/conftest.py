"""Shared fixtures. GPU tests are skipped where CUDA is absent."""

from __future__ import annotations

import os
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
