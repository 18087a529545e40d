#!/usr/bin/env python3
"""Generate the blocking client (``clients/_sync``) from the asyncio one (``clients/_async``).

    python scripts/unasync.py          # write clients/_sync
    python scripts/unasync.py --check  # exit 1 if clients/_sync is not what it would write

The ``unasync`` package replaces tokens: ``async`` and ``await`` go, ``__aenter__`` becomes
``__enter__``, ``AsyncIterator`` ``Iterator`` and so on. On top of its table: each name
``AsyncX`` becomes ``X`` (the blocking classes keep the public names; unasync alone would
write ``SyncX``), ``async_x`` becomes ``sync_x`` (the backend modules of ``clients/_backends``)
and ``_async`` becomes ``_sync`` (import paths). ruff then sorts the imports and formats the
result with the repository's settings, so the generated modules pass ``ruff check`` and
``ruff format --check`` as they are.
"""

from __future__ import annotations

import argparse
import difflib
import io
import re
import shutil
import subprocess
import sys
import tempfile
import tokenize
from pathlib import Path

# This script shares the package's name: import the package, not the script itself.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
import unasync  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "clients" / "_async"
TARGET = ROOT / "clients" / "_sync"
HEADER = (
    "# GENERATED from clients/_async/{name} by scripts/unasync.py: do not edit.\n"
    "# Change the asyncio source, then run `python scripts/unasync.py`.\n"
)


def replacements(sources: list[str]) -> dict[str, str]:
    """The names to replace beyond unasync's own table, found in the sources' tokens."""
    table = {"_async": "_sync"}
    for text in sources:
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            name = token.string
            if token.type != tokenize.NAME:
                continue
            if re.fullmatch(r"Async[A-Z]\w*", name):
                table[name] = name.removeprefix("Async")
            elif name.startswith("async_"):
                table[name] = "sync_" + name.removeprefix("async_")
    return table


def ruff(args: list[str], text: str) -> str:
    """``text`` passed through ``ruff`` (reading stdin, as if it were the file named in args)."""
    done = subprocess.run(
        [sys.executable, "-m", "ruff", *args],
        input=text,
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    if done.returncode != 0 or not done.stdout:
        sys.exit(f"ruff {' '.join(args)} failed:\n{done.stderr}")
    return done.stdout


def generate() -> dict[Path, str]:
    """Each module of ``clients/_sync`` and its text, generated from ``clients/_async``."""
    sources = sorted(SOURCE.glob("*.py"))
    table = replacements([p.read_text() for p in sources])
    out: dict[Path, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "_async"
        work.mkdir()
        for path in sources:
            shutil.copy(path, work / path.name)
        rule = unasync.Rule("/_async/", "/_sync/", additional_replacements=table)
        unasync.unasync_files([str(work / p.name) for p in sources], [rule])
        for path in sources:
            text = HEADER.format(name=path.name) + (Path(tmp) / "_sync" / path.name).read_text()
            name = str((TARGET / path.name).relative_to(ROOT))
            text = ruff(["check", "--fix", "--select", "I", "--stdin-filename", name, "-"], text)
            out[TARGET / path.name] = ruff(["format", "--stdin-filename", name, "-"], text)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--check", action="store_true", help="report drift, write nothing")
    args = parser.parse_args()
    wanted = generate()
    stale = [p for p in TARGET.glob("*.py") if p not in wanted]
    changed = [p for p, text in wanted.items() if not p.exists() or p.read_text() != text]
    if args.check:
        for path in changed:
            old = path.read_text().splitlines(keepends=True) if path.exists() else []
            new = wanted[path].splitlines(keepends=True)
            rel = str(path.relative_to(ROOT))
            sys.stdout.writelines(difflib.unified_diff(old, new, rel, rel))
        for path in stale:
            print(f"{path.relative_to(ROOT)}: no source in clients/_async")
        if changed or stale:
            print("clients/_sync is out of date: run `python scripts/unasync.py`", file=sys.stderr)
            return 1
        return 0
    TARGET.mkdir(exist_ok=True)
    for path in changed:
        path.write_text(wanted[path])
        print(f"wrote {path.relative_to(ROOT)}")
    for path in stale:
        path.unlink()
        print(f"removed {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
