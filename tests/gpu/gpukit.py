"""Helpers shared by the GPU tests."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any


def run(code: str, *args: str, timeout: float = 300) -> Any:
    """Run ``code`` in a fresh Python process (its own CUDA context, like a real client)
    and return the JSON its last line of output prints; its stderr tail when it fails."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
