# GENERATED from clients/_async/state.py by scripts/unasync.py: do not edit.
# Change the asyncio source, then run `python scripts/unasync.py`.
"""What a client learned of its daemon and of this process, read and updated by its parts.

A path found not to work (another machine, no device pool, a capability the daemon lacks)
is recorded here once, so that every part of the client skips it from then on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from embcache.clients.core.capabilities import Capabilities, HostFallbacks
from embcache.clients.device.pools import DevicePoolCache, process_device_pools
from embcache.clients.device.read_table import ReadTables, process_read_tables
from embcache.clients.device.shm import PoolMaps, process_pool_maps


@dataclass(slots=True)
class ClientState:
    """The client's knowledge of where the daemon's memory is and which paths work."""

    # On the daemon's node, host entries of at most this many bytes come back as copies
    # (0: always views); set once by the client.
    copy_gets_up_to: int
    caps: Capabilities = field(default_factory=Capabilities)  # optional paths still in use
    no_device: HostFallbacks = field(default_factory=HostFallbacks)  # GPUs served via host
    # Whether this process maps the daemon's host pool (None: not known yet); set by gets.
    pool_local: bool | None = None
    # Process-wide caches: the host pool's maps, the read tables and the device pools.
    maps: PoolMaps = field(default_factory=process_pool_maps)
    tables: ReadTables = field(default_factory=process_read_tables)
    device_pools: DevicePoolCache = field(default_factory=process_device_pools)
