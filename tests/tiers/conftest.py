"""Shared-tier tests: real stores on 127.0.0.1 (``tier_servers.py``), engines on the CPU."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:  # --import-mode=importlib does not put test folders on sys.path
    sys.path.insert(0, HERE)

from tier_helpers import POOL, Node, new_node  # noqa: E402
from tier_servers import RedisNodes, redis_missing  # noqa: E402

from embcache.service.shared_tier import SharedTierConfig  # noqa: E402


@pytest.fixture
def make_node() -> Iterator[Callable[..., Node]]:
    made: list[Node] = []

    def make(url: str, tag: str = "n", pool_bytes: int = POOL, **knobs: Any) -> Node:
        knobs.setdefault("timeout_s", 1.0)
        knobs.setdefault("probe_interval_s", 0.1)
        engine, tier = new_node(tag, SharedTierConfig.from_url(url, **knobs), pool_bytes)
        made.append((engine, tier))
        return engine, tier

    yield make
    for engine, tier in made:
        tier.close()
        engine.close()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisNodes]:
    reason = redis_missing()
    if reason:
        pytest.skip(reason)
    nodes = RedisNodes(tmp_path_factory.mktemp("redis-cluster"), 3, cluster=True)
    try:
        nodes.start()
        yield nodes
    finally:
        nodes.close()


@pytest.fixture
def prefix() -> str:
    """A key prefix no other test uses (tests share one cluster)."""
    return f"t{uuid.uuid4().hex[:8]}:"
