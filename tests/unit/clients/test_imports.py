"""The client installs and runs without the daemon: nothing it imports reaches embcache.service.

Every import of every client module counts (type-only ones under ``TYPE_CHECKING`` and those
inside functions too), followed through the other embcache packages the client uses
(proto, kernels, errors), read from the source rather than imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import embcache

ROOT = Path(embcache.__file__).parent  # the repository root is the package root
FORBIDDEN = "embcache.service"


def source_of(module: str) -> Path | None:
    """The file of an embcache module (package or plain module); None outside embcache."""
    if module != "embcache" and not module.startswith("embcache."):
        return None
    base = ROOT.joinpath(*module.split(".")[1:])
    for path in (base / "__init__.py", base.with_suffix(".py")):
        if path.is_file():
            return path
    return None


def imports_in(module: str, path: Path) -> set[str]:
    """Every module name an import statement of ``path`` names (``from a import b``: ``a``
    and ``a.b``, which may be a submodule)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def client_modules() -> list[str]:
    clients = ROOT / "clients"
    out = []
    for path in sorted(clients.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out.append(".".join(("embcache", *parts)))
    return out


def reached_from(start: list[str]) -> dict[str, str]:
    """Each embcache module reached from ``start``, mapped to the module that imports it."""
    seen = {name: "" for name in start}
    todo = list(start)
    while todo:
        module = todo.pop()
        path = source_of(module)
        if path is None:
            continue
        for name in imports_in(module, path):
            if (name == "embcache" or name.startswith("embcache.")) and name not in seen:
                seen[name] = module
                todo.append(name)
    return seen


def test_the_walk_finds_the_clients_imports() -> None:
    reached = reached_from(["embcache.clients"])
    assert {"embcache.errors", "embcache.proto.framing", "embcache.kernels.cuda_ipc"} <= set(
        reached
    )
    assert "embcache.clients._sync.client" in reached_from(client_modules())


def test_no_client_module_reaches_the_daemon() -> None:
    reached = reached_from(client_modules())
    bad = sorted(name for name in reached if name.startswith(FORBIDDEN))
    chains = []
    for name in bad:
        chain = [name]
        while reached.get(chain[-1]):
            chain.append(reached[chain[-1]])
        chains.append(" <- ".join(chain))
    assert not bad, "the client reaches the daemon's package:\n" + "\n".join(chains)
