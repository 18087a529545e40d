"""Device-resident hits from the read table on a GPU: ``embcache serve`` with a device pool
(fd and legacy IPC) and a client process that makes entries resident through one device get,
then copies them device to device with no call (``clients/device/table_device.py``).

Checked: the slots offer the device runs once the daemon's copies are complete; the copies
into poisoned buffers match bit for bit, on the default and on a side stream; the daemon
counts no hit and copies nothing meanwhile (no call was made); a device eviction withdraws
the runs at once; and while another client churns the device pool (evicting and reusing
pages all the time), every table read that passes its check holds its own entry's bytes,
never another's.

Every process started here is stopped by its pid. Run on a GPU machine with:
    pytest -m gpu tests/gpu/test_table_device.py
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest
from gpukit import run

from embcache.service.daemon_process import DaemonProcess

pytestmark = pytest.mark.gpu


@pytest.fixture(params=["fd", "legacy"])
def target(request: pytest.FixtureRequest) -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="ectab-") as tmp:
        sock = os.path.join(tmp, "g.sock")
        flags = ["--grpc-socket", sock, "--host-pool-bytes", "512MiB"]
        # 64 MiB of device pages: the churn below overfills it many times over
        flags += ["--device-pool-bytes", "64MiB", "--ipc-mode", request.param]
        child = DaemonProcess([*flags, "--drain-grace-s", "1"], timeout=180)
        try:
            assert child.ready["device_pools"], child.ready
            yield f"unix:{sock}"
        finally:
            assert child.stop(timeout=30) == 0


CLIENT = """
import json, random, sys, threading, time
import torch
from embcache.clients import EmbCacheClient
from embcache.errors import EntryLeased
from embcache.clients.device.read_table import process_read_tables
from embcache.clients.device.table_device import (
    copy_from_device_pool, placement_on, process_table_pools, read_into,
)

MiB = 1 << 20
target = sys.argv[1]
g = torch.Generator().manual_seed(7)
# odd sizes: the last device page of each entry is partly used
want = {f"k{i}": torch.randint(0, 256, (4 * MiB - 4099 * i,), dtype=torch.uint8, generator=g)
        for i in range(4)}
filler = {f"f{i}": torch.randint(0, 256, (4 * MiB,), dtype=torch.uint8, generator=g)
          for i in range(40)}
on_gpu = {k: t.cuda() for k, t in want.items()}
out = {}


def poisoned(n):
    return torch.full((n,), 0xA5, dtype=torch.uint8, device="cuda")


def wait_offered(table, keys, present=True, limit_s=15.0):
    # the daemon offers a copy once its event has fired: after the reply's housekeeping or
    # from its reaper (at least once a second)
    give_up = time.monotonic() + limit_s
    while time.monotonic() < give_up:
        found = [table.locate(k) for k in keys]
        if all(f is not None and bool(f.devices) == present for f in found):
            return found
        time.sleep(0.05)
    raise AssertionError(f"not offered in time: {[(k, f) for k, f in zip(keys, found)]}")


with EmbCacheClient(target) as client:
    for k, t in {**want, **filler}.items():
        assert client.put(k, t) is True, k
    table = process_read_tables().get(client._conn.open_session().read_table)
    assert table is not None, "no read table offered"
    pools = table.device_pools
    assert len(pools) == 1 and pools[0].WhichOneof("kind") == "device", pools
    assert all(not table.locate(k).devices for k in want), "device runs before any device get"

    with client.get(list(want), device="cuda", zero_copy=True) as got:  # a call: resident
        assert all(torch.equal(x, on_gpu[k]) for k, x in zip(want, got))
    del got  # the views' leases end once the block has ended and the views are gone
    found = wait_offered(table, list(want))
    for f in found:
        p = placement_on(f, pools, torch.device("cuda", 0))
        assert p is not None and p.pool == 0, f

    # no call from here on: the daemon counts no hit and copies nothing
    before = client.stats()
    reads = 0
    for _ in range(25):
        for k, t in on_gpu.items():
            dst = poisoned(t.numel())
            assert read_into(table, k, dst) is not None, k
            assert torch.equal(dst, t), k
            reads += 1
    side = torch.cuda.Stream()
    for k, t in on_gpu.items():  # the API the client's get uses, on a side stream
        loc = table.locate(k)
        dst = poisoned(t.numel())
        event = copy_from_device_pool(loc, placement_on(loc, pools, dst.device), pools, dst, side)
        assert event is not None
        event.synchronize()
        assert table.unchanged(loc) and torch.equal(dst, t), k
    after = client.stats()
    for field in ("hits", "misses"):
        assert after[field] == before[field], (field, before[field], after[field])
    assert after["bytes_copied"] == before["bytes_copied"], (before, after)
    rt_stats = after["read_table"]
    assert rt_stats["device_published"] >= len(want), rt_stats
    out["reads"] = reads

    # a device eviction withdraws the runs before the call returns (the views' release is
    # posted, so it may reach the daemon just after the first try)
    for _ in range(100):
        try:
            assert client.evict("k0", device="cuda") == "evicted"
            break
        except EntryLeased:
            time.sleep(0.05)
    else:
        raise AssertionError("k0 stayed leased after its views were gone")
    loc = table.locate("k0")
    assert loc is not None and not loc.devices, loc
    assert read_into(table, "k0", poisoned(want["k0"].numel())) is None
    assert client.stats()["read_table"]["device_withdrawn"] >= 1

    # churn: another client makes filler entries resident (a 64 MiB pool: the tracked
    # entries are evicted and their pages reused over and over) while this one reads
    stop = threading.Event()
    churned = [0]
    errors = []

    def churn():
        rnd = random.Random(3)
        names = list(filler) + list(want)
        try:
            with EmbCacheClient(target) as other:
                while not stop.is_set():
                    keys = rnd.sample(names, 4)
                    with other.get(keys, device="cuda", zero_copy=True):  # a call: made resident
                        churned[0] += 1
        except BaseException as exc:
            errors.append(repr(exc))

    worker = threading.Thread(target=churn)
    worker.start()
    served = fallbacks = 0
    give_up = time.monotonic() + 20
    try:
        while time.monotonic() < give_up and (served < 200 or churned[0] < 50):
            for k, t in on_gpu.items():
                dst = poisoned(t.numel())
                if read_into(table, k, dst) is None:
                    fallbacks += 1
                    continue
                served += 1
                assert torch.equal(dst, t), f"foreign bytes for {k} after {served} reads"
    finally:
        stop.set()
        worker.join(timeout=60)
    assert not errors, errors
    assert churned[0] > 0, "the churn made no get"
    s = client.stats()
    assert s["read_table"]["device_withdrawn"] > 1, s["read_table"]
    out.update(served=served, fallbacks=fallbacks, churned=churned[0],
               table=s["read_table"], opened=len(process_table_pools()._opened))
print(json.dumps(out))
"""


def test_resident_entries_are_read_device_to_device_without_a_call(target: str) -> None:
    result = run(CLIENT, target, timeout=400)
    assert result["reads"] == 100 and result["served"] > 0, result
    assert result["opened"] == 1, result
