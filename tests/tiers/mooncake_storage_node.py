"""A Mooncake Store storage node for tests: mounts a memory segment, says "ready", waits.

Usage: ``python mooncake_storage_node.py MASTER_HOST:PORT SEGMENT_BYTES``. It exits when its
stdin closes or on SIGTERM. Started only inside the test's private network namespace,
because the transfer engine's listeners bind every interface.
"""

from __future__ import annotations

import signal
import sys
import threading


def main() -> int:
    from mooncake.store import MooncakeDistributedStore

    master, segment = sys.argv[1], int(sys.argv[2])
    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", segment, 0, "tcp", "", master)
    if rc != 0:
        print(f"setup failed: {rc}", flush=True)
        return 1
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    print("ready", flush=True)
    done.wait()
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
