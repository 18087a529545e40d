"""A wheel built from the checkout: quiet (setuptools has nothing to warn about), with the
data the daemon serves, and an ``embcache bench`` from it that says where benchmarks are."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import embcache

REPO = Path(embcache.__file__).resolve().parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """(the wheel, the build's output), built from a copy of the tracked files."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO,
                            capture_output=True, timeout=60)  # fmt: skip
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    src = tmp_path_factory.mktemp("src")
    for name in listed.stdout.decode().split("\0"):
        path = REPO / name
        if name and path.is_file() and not path.is_symlink():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            (src / name).write_bytes(path.read_bytes())
    out = tmp_path_factory.mktemp("dist")
    cmd = [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation",
           "--no-index", "-w", str(out), str(src)]  # fmt: skip
    built = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    [whl] = out.glob("embcache-*.whl")
    return whl, built.stdout + built.stderr


def test_the_build_is_quiet(wheel: tuple[Path, str]) -> None:
    _, log = wheel
    assert "absent from the `packages` configuration" not in log
    assert "BuildBackendWarning" not in log and "SetuptoolsDeprecationWarning" not in log


def test_the_wheel_holds_the_served_data_and_no_repository_folders(wheel: tuple[Path, str]) -> None:
    whl, _ = wheel
    names = zipfile.ZipFile(whl).namelist()
    static = REPO / "service" / "transport" / "http" / "static"
    for path in static.iterdir():
        assert f"embcache/service/transport/http/static/{path.name}" in names
    assert "embcache/proto/embcache/v1/embcache.proto" in names
    assert "embcache/proto/embcache/v1/embcache_pb2.py" in names
    for folder in ("bench", "tests", "docs", "scripts"):
        assert not [n for n in names if n.startswith(f"embcache/{folder}/")], folder


def test_bench_from_the_wheel_says_where_the_benchmarks_are(
    wheel: tuple[Path, str], tmp_path: Path
) -> None:
    whl, _ = wheel
    target = tmp_path / "site"
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target",
           str(target), str(whl)]  # fmt: skip
    subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBCACHE_")}
    env["PYTHONPATH"] = str(target)  # the installed package, not the checkout
    run = [sys.executable, "-m", "embcache.service.cli", "bench", "--list"]
    out = subprocess.run(run, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    message = " ".join(out.stderr.split())
    assert "no bench/ folder" in message and "source repository" in message, message
    assert "--bench-dir" in message and "Traceback" not in out.stderr
