"""Importing embcache, its integrations packages and their engine-free modules never
imports vLLM or SGLang (they are optional extras), and the entry points are installed."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

ENGINE_FREE = [
    "embcache",
    "embcache.clients",
    "embcache.integrations",
    "embcache.integrations.keys",
    "embcache.integrations.vllm",
    "embcache.integrations.vllm.settings",
    "embcache.integrations.sglang",
    "embcache.integrations.sglang.buffers",
    "embcache.integrations.sglang.launch",
    "embcache.integrations.vllm.lookups",
    "embcache.integrations.vllm.closing",
]


def test_importing_embcache_imports_no_engine() -> None:
    code = (
        f"import importlib, sys\nfor m in {ENGINE_FREE!r}: importlib.import_module(m)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'sglang'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_entry_points_name_the_register_functions() -> None:
    vllm = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    sglang = {e.name: e.value for e in entry_points(group="sglang.srt.plugins")}
    assert vllm.get("embcache") == "embcache.integrations.vllm:register"
    assert sglang.get("embcache") == "embcache.integrations.sglang:register"
