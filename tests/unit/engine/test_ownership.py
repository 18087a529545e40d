"""The engine owns its parts and they never call back up: none of what it builds holds a
reference to the engine, the host store's tables change only through its methods, and the
host layer takes no lock of the engine's."""

from __future__ import annotations

import ast
import gc
import types
from pathlib import Path

import numpy as np
import torch

from embcache.service.config import Settings
from embcache.service.engine import CacheEngine
from embcache.service.host.store import HostStore

PAGE = 4096
ROOT = Path(__file__).resolve().parents[3]


def _engine(shm_name: str, **kw: object) -> CacheEngine:
    s = Settings(host_pool_bytes=64 * PAGE, page_bytes=PAGE, shm_name=shm_name, device="cpu", **kw)
    return CacheEngine(s)


def _holders(engine: CacheEngine) -> list[object]:
    """What refers to ``engine`` other than frames (this test's locals)."""
    gc.collect()
    return [r for r in gc.get_referrers(engine) if not isinstance(r, types.FrameType)]


def test_nothing_the_engine_builds_refers_back_to_it(shm_name: str) -> None:
    engine = _engine(shm_name, warm_restart=True)
    try:
        engine.put("a", torch.zeros(300, dtype=torch.uint8))
        handle = engine.begin_put("b", "uint8", (10,))  # an open put's handle too
        assert _holders(engine) == []
        handle.write(np.zeros(10, dtype=np.uint8))
        assert handle.commit() is True
        assert _holders(engine) == []
    finally:
        engine.close()


def test_the_store_tables_are_private(shm_name: str) -> None:
    with _engine(shm_name) as engine:
        store = engine.host_store
        for name in ("alloc", "entries", "counters"):
            assert not hasattr(store, name), name
        try:
            store.index = None  # type: ignore[misc]
        except AttributeError:
            pass
        else:
            raise AssertionError("the store's index can be replaced from outside")
        assert "StoreViews" not in {c.__name__ for c in HostStore.__mro__}  # no mixins


def _imports_and_locks(path: Path) -> tuple[set[str], list[int]]:
    tree = ast.parse(path.read_text())
    mods = set()
    withs = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            mods.add(node.module)
        elif isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
        elif isinstance(node, ast.With):
            text = ast.unparse(node.items[0].context_expr)
            if "lock" in text.lower() or "gate" in text.lower():
                withs.append(node.lineno)
    return mods, withs


def test_the_host_layer_takes_no_engine_lock() -> None:
    for path in sorted((ROOT / "service" / "host").glob("*.py")):
        mods, withs = _imports_and_locks(path)
        assert not any(m.startswith("embcache.service.engine") for m in mods), path.name
        if path.name != "put_writer.py":  # one handle's own state, shared with no table
            assert "threading" not in mods and not withs, (path.name, withs)


def test_no_engine_or_host_module_is_over_400_lines() -> None:
    for package in ("engine", "host"):
        for path in sorted((ROOT / "service" / package).glob("*.py")):
            assert len(path.read_text().splitlines()) <= 400, path.name
