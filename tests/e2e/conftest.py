"""End-to-end suite: the headless-Chromium helper lives in ``pagekit`` next to this file."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:  # --import-mode=importlib does not put test folders on sys.path
    sys.path.insert(0, HERE)
