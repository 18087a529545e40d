"""Build hook: generate the protobuf stubs from the .proto before packages are collected.

All metadata lives in pyproject.toml. This file only swaps in a ``build_py`` that runs
grpcio-tools (a build requirement) first, so a wheel, an sdist build and ``pip install -e .``
all get a ``_pb2.py`` and a ``_pb2.pyi`` per .proto file (the gRPC stub is derived from them
at import, ``proto/embcache/v1/services.py``).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

_HERE = Path(__file__).resolve().parent


def _load_codegen():
    # The package is not importable yet: load the generator by path (it imports nothing
    # from embcache).
    spec = importlib.util.spec_from_file_location(
        "_embcache_codegen", _HERE / "proto" / "codegen.py"
    )
    assert spec is not None and spec.loader is not None, "proto/codegen.py is missing"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithStubs(build_py):
    """``build_py`` that generates the protobuf stubs first."""

    def run(self) -> None:
        for path in _load_codegen().generate():
            self.announce(f"generated {path.relative_to(_HERE)}", level=2)
        super().run()

    def find_package_modules(self, package: str, package_dir: str) -> list[tuple[str, str, str]]:
        # The repository root is the package root, so this file would ship as
        # ``embcache.setup``; it is a build script, not a module.
        modules = super().find_package_modules(package, package_dir)
        return [m for m in modules if (m[0], m[1]) != ("embcache", "setup")]


# Folders under the root that are not part of the package.
_NOT_PACKAGES = {"tests", "bench", "scripts", "deploy", "docs", "build", "dist", "_gen"}


def _packages() -> list[str]:
    """``embcache``, every folder below the root that has an ``__init__.py``, and the data
    folders inside those packages (``service/transport/http/static``): setuptools treats
    any folder it ships as a package, and warns about each one not listed here. Their files
    are declared in pyproject.toml's ``package-data``."""
    found = ["embcache"]
    for top in sorted(_HERE.iterdir()):
        if not top.is_dir() or top.is_symlink() or top.name in _NOT_PACKAGES:
            continue
        if top.name.startswith("."):
            continue
        for folder, dirs, files in os.walk(top):  # links are not followed
            dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
            rel = Path(folder).relative_to(_HERE)
            parent_is_package = (Path(folder).parent / "__init__.py").is_file()
            if "__init__.py" in files or (parent_is_package and files and rel.name.isidentifier()):
                found.append(".".join(("embcache", *rel.parts)))
    return found


if __name__ == "__main__":  # setuptools runs this file as a script; tests import it
    setup(packages=_packages(), cmdclass={"build_py": BuildPyWithStubs})
