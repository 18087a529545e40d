"""Which build this is: the package version and the git commit it came from.

The commit is ``EMBCACHE_GIT_COMMIT`` when set (images and packages built without a
``.git``: ``docker build --build-arg GIT_COMMIT=...``), else what ``git`` says about the
checkout the package was imported from, else ``"unknown"``. Nothing here imports the
service or the client; both ask this module.
"""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path

from embcache import __version__

COMMIT_ENV = "EMBCACHE_GIT_COMMIT"


@functools.cache
def git_commit() -> str:
    """The short commit (12 hex digits) of this build, or ``"unknown"``."""
    if env := os.environ.get(COMMIT_ENV, "").strip():
        return env
    root = Path(__file__).resolve().parent
    if not (root / ".git").exists():
        return "unknown"
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def version() -> str:
    return __version__


def as_dict() -> dict[str, str]:
    """``{"version": ..., "commit": ...}``, as stats documents carry them."""
    return {"version": __version__, "commit": git_commit()}


def describe() -> str:
    """``0.1.0 (commit 0123456789ab)``: what ``embcache --version`` prints."""
    return f"{__version__} (commit {git_commit()})"


__all__ = ["COMMIT_ENV", "as_dict", "describe", "git_commit", "version"]
