"""The Mooncake Store scenario, run by test_mooncake_tier.py inside a private network namespace.

Mooncake's transfer engine binds its TCP data and handshake listeners to every interface
(the package has no bind option for them), so this script refuses to run anywhere but a
fresh network namespace whose only interface is loopback: there, "every interface" is
127.0.0.1. It starts a master (RPC and metrics on 127.0.0.1), a storage node and three
engines, runs the checks and prints one JSON line ``{"failed": [...], "passed": [...]}``.
"""

from __future__ import annotations

import fcntl
import json
import socket
import struct
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from tier_helpers import fragment, new_node, payload, read_entry  # noqa: E402
from tier_servers import MooncakeMaster, start_storage_node, stop  # noqa: E402

from embcache.service.shared_tier import SharedTierConfig  # noqa: E402
from embcache.service.shared_tier.base import HEADER_BYTES, object_name  # noqa: E402

SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


def loopback_only_namespace() -> None:
    """Bring ``lo`` up; refuse to go on if any other interface exists."""
    names = [
        line.split(":")[0].strip() for line in Path("/proc/net/dev").read_text().splitlines()[2:]
    ]
    if names != ["lo"]:
        raise SystemExit(f"not in a loopback-only network namespace (interfaces: {names})")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifr = struct.pack("16sH", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(s, SIOCGIFFLAGS, ifr)[:18])[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | IFF_UP))


def wait_for(cond: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def run(workdir: Path, passed: list[str], failed: list[str]) -> None:
    def check(name: str, ok: bool) -> None:
        (passed if ok else failed).append(name)

    master = MooncakeMaster(workdir).start()
    storage = start_storage_node(workdir, master.port, 64 * 1024 * 1024)
    made = []
    try:
        url = f"mooncake://127.0.0.1:{master.port}?prefix=t/"
        for tag in ("a", "b", "c"):
            config = SharedTierConfig.from_url(url, timeout_s=1.0, probe_interval_s=0.1)
            made.append(new_node(tag, config))
        (a, ta), (b, tb), (c, _) = made
        fragment(b)
        small, big = payload(3002, seed=1), payload(700_000, seed=2)
        a.put("small", small)
        a.put("big", big)
        check("flush", ta.flush(10))
        check("exists_remote", b.exists(["big", "nope"]) == [True, False])
        for engine, tag in ((b, "b"), (c, "c")):
            check(f"small_on_{tag}", read_entry(engine, "small") == small.numpy().tobytes())
            check(f"big_on_{tag}", read_entry(engine, "big") == big.numpy().tobytes())
        info = b.entry_info("big")
        check("scattered_runs", info is not None and len(info.page_runs) > 1)
        check("fetch_hits_b", tb.stats()["fetch_hits"] == 2)

        a.evict(["big"])
        check("evicted_still_served", read_entry(a, "big") == big.numpy().tobytes())

        # Corrupt one payload byte of "small" in the store: B must not serve it.
        b.evict(["small"])
        store = ta.backend()._store  # type: ignore[union-attr]
        name = object_name("t/", "small")
        raw = bytearray(store.get(name))
        raw[HEADER_BYTES + 77] ^= 0xFF
        check("corrupt_remove", store.remove(name, True) == 0)
        check("corrupt_put", store.put(name, bytes(raw)) == 0)
        check("corrupt_is_miss", read_entry(b, "small") is None)
        check("corrupt_counted", tb.stats()["fetch_corrupt"] == 1)
        check("corrupt_nothing_left", b.entry_info("small") is None)

        master.kill()
        t0 = time.monotonic()
        fresh = payload(60_000, seed=7)
        a.put("during", fresh)  # local put goes on; write-through fails
        check("local_get_during_outage", read_entry(a, "during") == fresh.numpy().tobytes())
        check("remote_miss_during_outage", read_entry(b, "during") is None)
        check("degraded", wait_for(lambda: not tb.health.ok, 10))
        check("fast_miss_when_degraded", read_entry(b, "other") is None)
        check("outage_bounded", time.monotonic() - t0 < 15)
        check("errors_counted", sum(tb.stats()["errors"].values()) >= 1)
        master = MooncakeMaster(workdir, port=master.port).start()
        check("recovered", wait_for(lambda: ta.health.ok and tb.health.ok, 20))
        after = payload(40_000, seed=8)
        ok = False
        for _ in range(40):  # the storage node re-mounts its segment on the new master
            a.evict(["after"])
            a.put("after", after)
            ta.flush(5)
            if b.exists(["after"]) == [True]:
                ok = True
                break
            time.sleep(0.25)
        check("write_after_restart", ok)
        check("read_after_restart", read_entry(b, "after") == after.numpy().tobytes())
    finally:
        for engine, tier in made:
            tier.close()
            engine.close()
        stop(storage)
        master.close()


def main() -> int:
    loopback_only_namespace()
    passed: list[str] = []
    failed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="embcache-mooncake-") as tmp:
        try:
            run(Path(tmp), passed, failed)
        except Exception:
            failed.append("exception: " + traceback.format_exc(limit=8))
    print(json.dumps({"passed": passed, "failed": failed}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
