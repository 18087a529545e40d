"""Reliability suite: the harness lives in ``relkit`` next to this file.

Each module prints its figures table at the end (``pytest -s`` shows it) and, when
``EMBCACHE_RELIABILITY_JSON`` names a file, merges its figures into it.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:  # --import-mode=importlib does not put test folders on sys.path
    sys.path.insert(0, HERE)
