"""Whether this process will run as a client of an MPS control daemon.

Without MPS the GPU time-slices between processes' contexts: any kernel the daemon launches
(page-table updates, the copy kernel) takes the GPU from a co-located decoder's GEMM for a
slice, and even copy-engine DMA from another context costs it some (docs/deploy.md, "MPS").
CUDA connects a process to the control daemon whose pipe directory is
``CUDA_MPS_PIPE_DIRECTORY`` (default ``/tmp/nvidia-mps``) when its context is created.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"


def control_pipe(environ: dict[str, str] | None = None) -> Path | None:
    """The MPS control daemon's pipe CUDA would connect to from this environment, if one
    exists (a Unix socket with driver 580; a FIFO is taken too)."""
    env = os.environ if environ is None else environ
    pipe = Path(env.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_PIPE_DIRECTORY, "control")
    try:
        mode = pipe.stat().st_mode
    except OSError:
        return None
    return pipe if stat.S_ISSOCK(mode) or stat.S_ISFIFO(mode) else None
