"""Adoption applies every check a put applies, against real daemons: index records that are
framed and checksummed (so whole, not torn) but describe an entry a put would refuse are
dropped, counted and logged at a warm start, never served, and the replay goes on to the
valid records after them (one of an unknown dtype included)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from relkit import daemon as dm
from relkit import figures, payload

from embcache.clients import EmbCacheClient
from embcache.proto.dtypes import DType
from embcache.service.host import index_records as rec
from embcache.service.host.pool_index import replay

NBYTES = 64 << 10  # bfloat16 rows of 1024: 32 rows
FIG: dict[str, object] = {}


@pytest.fixture
def spec(tmp_path: Path) -> Iterator[dm.DaemonSpec]:
    s = dm.DaemonSpec(tmp_path, pool="16MiB", warm_restart=True, drain_grace_s=1.0)
    yield s
    for suffix in ("", ".index", ".index.tmp", ".reads"):
        dm.SHM_DIR.joinpath(s.shm_name + suffix).unlink(missing_ok=True)


def repoint(a: rec.AddRecord, key: str, **change: Any) -> bytes:
    """Records that move entry ``a``'s pages (and CRC32, so its bytes pass their check) to
    ``key`` with ``change``d metadata: what a writer of the index could append."""
    fields = {"key": key, "dtype": a.dtype, "shape": a.shape, "nbytes": a.nbytes} | change
    new = rec.AddRecord(
        fields["key"], fields["dtype"], fields["shape"], fields["nbytes"], a.runs, a.crc,
        a.generation,
    )  # fmt: skip
    return rec.encode_del(a.key) + rec.encode_add(new)


@pytest.mark.parametrize("unknown_dtype", [True, False])
def test_records_a_put_would_refuse_are_dropped_and_the_next_one_is_served(
    spec: dm.DaemonSpec, unknown_dtype: bool
) -> None:
    keys = [f"e{i}" for i in range(7)]
    tensors = {k: payload.make(k, NBYTES, i) for i, k in enumerate(keys)}
    with dm.running(spec) as d, EmbCacheClient(d.unix, timeout=10) as client:
        for key, t in tensors.items():
            client.put(key, t)
    index = dm.SHM_DIR / (spec.shm_name + ".index")
    adds = replay(index).adds
    rows = NBYTES // 2
    unknown = DType("complex256", 32, torch.float32)  # no such dtype here
    bad = {
        "unknown dtype": repoint(adds["e0"], "nodtype", dtype=unknown, shape=(NBYTES // 32,)),
        "shape vs nbytes": repoint(adds["e1"], "shape", shape=(3, 5)),
        "12 dimensions": repoint(adds["e2"], "dims", shape=(1,) * 11 + (rows,)),
        "empty key": repoint(adds["e3"], ""),
        "key with NUL": repoint(adds["e4"], "a\x00b"),
        "5000-byte key": repoint(adds["e5"], "k" * 5000),
    }
    if not unknown_dtype:  # then nothing stops the replay of the others
        del bad["unknown dtype"]
    good = repoint(adds["e6"], "after")  # valid, after every bad one
    with index.open("ab") as f:
        f.write(b"".join(bad.values()) + good)
    with dm.running(spec) as d, EmbCacheClient(d.unix, timeout=10) as client:
        with client.get(["after", "shape", "dims"]) as (after, shape, dims):
            assert after is not None and same_bytes(after, tensors["e6"])
            assert shape is None and dims is None
        del after, shape, dims
        stats = d.stats()
        restart = stats["restart"]
        assert restart["dropped_refused_entries"] == len(bad), restart
        moved = len(bad) + 1  # entries whose records were moved to other keys
        assert restart["adopted_entries"] == len(keys) - moved + 1, restart
        assert stats["entries_ready"] == len(keys) - moved + 1, stats["entries_ready"]
        log = d.log_tail(50000)
        assert log.count("index record of key") == len(bad), log
        metrics = httpx_metrics(d)
        assert f'embcache_restart_dropped_entries{{reason="refused"}} {len(bad)}.0' in metrics
    FIG["refused index records"] = f"{len(bad)} dropped, counted, logged; the next one served"


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bytes (random payload bytes read as bfloat16 hold NaNs: equal is not enough)."""
    flat = [t.contiguous().reshape(-1).view(torch.uint8) for t in (a, b)]
    return a.shape == b.shape and torch.equal(*flat)


def httpx_metrics(d: dm.Daemon) -> str:
    import httpx

    return httpx.get(d.http + "/metrics", headers=d.headers(), timeout=10).text


def test_zz_figures() -> None:
    print("\n" + figures.table("adoption checks (CI)", FIG))
    figures.save("adoption_checks", FIG)
