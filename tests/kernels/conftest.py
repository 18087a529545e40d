"""Fixtures for the kernel tests (helpers live in embcache.kernels.testing)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture
def interpret(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Run Triton kernels on CPU tensors in the interpreter.

    The kernels' modules are imported on first use and the mode is fixed when they are, so on
    a machine with a GPU (where they compile for the device) these tests are skipped unless the
    whole session runs interpreted.
    """
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("interpreter tests run on CPU-only machines (or with TRITON_INTERPRET=1)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield
