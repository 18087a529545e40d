"""``python -m embcache.integrations.sglang.launch``: registers the embcache backend, lets
``--mm-global-cache-backend embcache`` through SGLang's fixed choices, and hands the parsed
arguments to SGLang's own server entry point (stubbed here: no model server starts)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("sglang") is None:  # pragma: no cover - CI installs it
    pytest.skip("sglang is not installed (scripts/install_engines.sh)", allow_module_level=True)

from embcache.integrations.sglang.launch import split_backend

# Runs in a child: SGLang's run_server is replaced by a stub that reports what it got.
CHILD = r"""
import json, sys
import sglang.launch_server as entry
from sglang.srt.mem_cache.embedding_store import EmbeddingStoreFactory
seen = {}
def stub(server_args):
    seen["backend"] = server_args.mm_global_cache_backend
    seen["model"] = server_args.model_path
    seen["global_cache"] = server_args.enable_mm_global_cache
    seen["registered"] = EmbeddingStoreFactory._registry.get("embcache", {}).get("module_path")
entry.run_server = stub
from embcache.integrations.sglang import launch
sys.argv = ["launch", *sys.argv[1:]]
launch.main()
print(json.dumps(seen))
"""


def run_child(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", CHILD, *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parent,
    )


def test_hands_sglang_its_arguments_with_the_embcache_backend(tmp_path: Path) -> None:
    done = run_child(
        "--model-path",
        str(tmp_path / "model"),
        "--enable-mm-global-cache",
        "--mm-global-cache-backend",
        "embcache",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {
        "backend": "embcache",
        "model": str(tmp_path / "model"),
        "global_cache": True,
        "registered": "embcache.integrations.sglang.store",
    }


def test_other_backends_and_errors_are_sglangs(tmp_path: Path) -> None:
    done = run_child("--model-path", "m", "--mm-global-cache-backend=mooncake")
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["backend"] == "mooncake"
    bad = run_child("--model-path", "m", "--mm-global-cache-backend", "redis")
    assert bad.returncode != 0 and "invalid choice" in bad.stderr


def test_help_is_sglangs() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "embcache.integrations.sglang.launch", "--help"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--mm-global-cache-backend" in done.stdout and "--model-path" in done.stdout


def test_split_backend() -> None:
    assert split_backend(["--a", "--mm-global-cache-backend", "embcache", "--b"]) == (
        ["--a", "--b"],
        "embcache",
    )
    assert split_backend(["--mm-global-cache-backend=embcache"]) == ([], "embcache")
    assert split_backend(["--mm-global-cache-backend", "mooncake"]) == (
        ["--mm-global-cache-backend", "mooncake"],
        None,
    )
    with pytest.raises(SystemExit):
        split_backend(["--mm-global-cache-backend"])
