"""docs/deploy.md stays true to the files and numbers it describes."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="module")
def guide(repo: Path) -> str:
    return (repo / "docs" / "deploy.md").read_text(encoding="utf-8")


def test_every_repository_path_it_names_exists(repo: Path, guide: str) -> None:
    named = set(re.findall(r"`((?:deploy|docs|tests)/[\w./-]*|Dockerfile|\.dockerignore)`", guide))
    assert "deploy/kubernetes/" in named or any(p.startswith("deploy/") for p in named)
    missing = [p for p in sorted(named) if not (repo / p).exists()]
    assert not missing, missing


def test_startup_budget_table_follows_the_formula(guide: str) -> None:
    header = re.search(r"^\| pool \|(.*)\|$", guide, re.MULTILINE)
    budget = re.search(r"^\| startup budget \|(.*)\|$", guide, re.MULTILINE)
    assert header and budget
    pools = [float(c.strip().removesuffix(" GiB")) for c in header.group(1).split("|")]
    budgets = [float(c.strip().removesuffix(" s")) for c in budget.group(1).split("|")]
    for pool_gib, seconds in zip(pools, budgets, strict=True):
        assert seconds == pytest.approx(1.5 * (30 + 0.75 * pool_gib)), pool_gib


def test_the_daemonset_budget_it_quotes(
    repo: Path, guide: str, load_yaml: Callable[[Path], list[dict[str, Any]]]
) -> None:
    (daemonset,) = load_yaml(repo / "deploy" / "kubernetes" / "daemonset.yaml")
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    probe = container["startupProbe"]
    quoted = f"{probe['failureThreshold']} x {probe['periodSeconds']} s"
    assert quoted in guide
