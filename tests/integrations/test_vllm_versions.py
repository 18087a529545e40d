"""The vLLM tests once more against the other supported vLLM version.

The venv holds one vLLM (scripts/install_engines.sh: the newest supported); the other sits
in a folder of its own (``EMBCACHE_VLLM_OTHER``, or ``.venv/vllm-<version>``). This runs
the connector's test modules in a subprocess with that folder first on ``PYTHONPATH``,
and checks that the subprocess indeed imported that version.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
MODULES = ["test_vllm_connector.py", "test_vllm_faults.py"]


def other_vllm() -> Path | None:
    """The folder of the other vLLM version, where one is installed."""
    named = os.environ.get("EMBCACHE_VLLM_OTHER")
    if named:
        return Path(named)
    found = sorted((ROOT / ".venv").glob("vllm-*/vllm"))
    return found[-1].parent if found else None


def version_in(folder: Path) -> str | None:
    infos = sorted(folder.glob("vllm-*.dist-info"))
    return infos[0].name.removeprefix("vllm-").removesuffix(".dist-info") if infos else None


@pytest.mark.skipif(
    os.environ.get("EMBCACHE_VLLM_NESTED") == "1", reason="already the other version's run"
)
def test_vllm_tests_pass_against_the_other_version() -> None:
    folder = other_vllm()
    if folder is None or not (folder / "vllm").is_dir():
        pytest.skip("no second vLLM version installed (scripts/install_engines.sh)")
    version = version_in(folder)
    assert version is not None, f"{folder} holds no vllm dist-info"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")]),
        "EMBCACHE_VLLM_NESTED": "1",
        "EMBCACHE_VLLM_EXPECT": version,
    }
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            *[str(HERE / m) for m in MODULES],
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    tail = (run.stdout + run.stderr)[-6000:]
    assert run.returncode == 0, f"vLLM {version}:\n{tail}"
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1], tail
