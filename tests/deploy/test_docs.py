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


# -- what the repository says of itself: the product, not a machine or the history of the work
_MACHINE_PATH = re.compile(
    r"(?<![\w.-])/(?:"
    r"home/[a-z_][\w.-]*/"  # a user's home
    r"|root/(?!\.cache/pip\b)"  # root's home (a container build's pip cache mount is fine)
    r"|work/"  # a workspace of some machine
    r"|tmp/(?:pytest-of-|tmp[\w]{6,}|[\w.-]+-\d{3,}/)"  # a run's temporary folder
    r"|[\w./-]*?/(?:site-packages|\.venv|\.pyenv)/"  # an installed environment
    r")"
)
_HISTORY = re.compile(
    r"(?:\b|(?<=\\n))(?:issues?[\s-]+#?\d+|#\d{1,4}\b(?!\w)"  # issue numbers (also after "\n")
    r"|(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth"
    r"|thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth"
    r"|\d+(?:st|nd|rd|th))\s+session\b(?!\s+(?:of\s+)?(?:call|socket))"
    r"|session\s+of\s+the\s+day|scratch\s+runs?|the\s+H200\s+host|rounds?\s+\d+\b)",
    re.IGNORECASE,
)
# How the work went, as the docs and benchmarks must not tell it (a changelog may say what a
# behaviour "used to" be). "this session" stays fine where the session is the product's: a
# daemon serves this session, a lease of this session, this session's socket.
_NARRATION = re.compile(
    r"\b(?:(?<!\bof\s)(?<!\bon\s)(?<!\bfor\s)(?<!\bto\s)(?<!\bby\s)(?<!serves\s)(?<!\bends\s)"
    r"this\s+session\b(?!'s\s+(?:socket|calls?|streams?|ids?|lanes?|leases?)\b)"
    r"(?!\s+(?:socket|calls?|streams?|ids?|lanes?|leases?|ends|closes)\b)"
    r"|earlier\s+sessions?\b|host\s+instances?\b|earlier\s+runs?\b|used\s+to\s+(?:be|run)\b"
    r"|(?:start|end)\s+of\s+(?:the\s+)?session\)|sessions?\s+apart\b"
    r"|the\s+review\s+(?:after|replaced)|since\s+the\s+review\b)",
    re.IGNORECASE,
)
_TEXT_SUFFIXES = {".md", ".py", ".log", ".txt", ".json", ".toml", ".yaml", ".yml", ".sh", ".cfg",
                  ".ini", ".service", ".proto", ".html", ".js", ".css", ""}  # fmt: skip


def _tracked(repo: Path) -> list[Path]:
    import subprocess

    out = subprocess.run(["git", "ls-files", "-z"], cwd=repo, capture_output=True, timeout=60)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    names = [n for n in out.stdout.decode().split("\0") if n]
    return [repo / n for n in names if Path(n).suffix in _TEXT_SUFFIXES and (repo / n).is_file()]


def test_no_tracked_file_names_a_machine_path(repo: Path) -> None:
    found = []
    for path in _tracked(repo):
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if match := _MACHINE_PATH.search(line):
                found.append(f"{path.relative_to(repo)}:{number}: {match.group(0)}")
    assert not found, "\n".join(found[:40])


def test_the_docs_describe_the_product_not_the_history_of_the_work(repo: Path) -> None:
    pages = [*sorted((repo / "docs").glob("*.md")), repo / "README.md"]
    pages += sorted((repo / "bench").glob("*.py"))
    found = []
    for path in [*pages, repo / "CHANGELOG.md"]:
        patterns = (_HISTORY, _NARRATION) if path in pages else (_HISTORY,)
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for pattern in patterns:
                if match := pattern.search(line):
                    found.append(f"{path.relative_to(repo)}:{number}: {match.group(0)}")
    assert not found, "\n".join(found[:60])


@pytest.mark.parametrize(
    ("text", "bad"),
    [("see issue 30", True), ("(issue #28)", True), ("the eleventh session", True),
     ("Twelfth session (1a7dcfe)", True), ("a scratch run", True), ("on the H200 host", True),
     ("Fourteenth session (H200)", True), ("| issue-30 target |", True),
     ('print("\\nissue 30, CPU targets")', True),
     ("a session-socket round trip", False), ("the first session call", False),
     ("an H200 (commit 1a7dcfe)", False), ("the session's socket", False)])  # fmt: skip
def test_history_pattern(text: str, bad: bool) -> None:
    assert bool(_HISTORY.search(text)) is bad


@pytest.mark.parametrize(
    ("text", "bad"),
    [("Four runs this session (H200)", True), ("this session changed nothing", True),
     ("Also this session: device pools", True), ("this session's first run", True),
     ("Two runs of grpc_e2e.py this session, each", True), ("the earlier sessions", True),
     ("(a slow host instance: the floor)", True), ("on three host instances", True),
     ("Against the earlier runs one batch", True), ("an earlier run on another machine", True),
     ("GetInto used to run in a worker thread", True), ("used to be a gRPC client stream", True),
     ("| f7a4ed9 (start of session) |", True), ("the review after these runs replaced it", True),
     ("on the same kind of machine, one session apart", True), ("since the review, through", True),
     ("the leases of this session end with it", False), ("daemon serves this session.", False),
     ("send it on this session's socket", False), ("this session call returns", False),
     ("a release on the session before its next call", False), ("an H200 machine", False),
     ("an earlier record's runs overlap", False), ("its earlier binding has ended", False),
     ("the engine instances differ", False), ("a run on another H200 machine", False),
     ("are no longer anyone's", False), ("the reply is used to decode", False)],
)  # fmt: skip
def test_narration_pattern(text: str, bad: bool) -> None:
    assert bool(_NARRATION.search(text)) is bad


@pytest.mark.parametrize(
    ("text", "bad"),
    [("/" "root/work/x.log", True), ("/" "home/alice/src", True), ("/" "work/wt/x", True),
     ("/opt/torch/" ".venv/lib/python3.12/site-packages/torch", True),
     ("/tmp/" "pytest-of-root/p0", True),
     ("/opt/embcache/bin/python", False), ("/dev/shm/embcache-7470", False),
     ("--mount=type=cache,target=/root/.cache/pip", False), ("/tmp/embcache-7470.fds", False)],
)  # fmt: skip
def test_machine_path_pattern(text: str, bad: bool) -> None:
    # (the paths above are split in two so that this file does not name them itself)
    assert bool(_MACHINE_PATH.search(text)) is bad
