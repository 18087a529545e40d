"""Python client library of embcache (sync and asyncio).

``EmbCacheClient(target)`` / ``AsyncEmbCacheClient(target)``; targets are ``unix:/path`` or
``host:port``. The daemon's typed errors are the classes of ``embcache.errors``. See
docs/grpc.md.
"""

from embcache.clients._async.client import AsyncEmbCacheClient
from embcache.clients._async.results import AsyncLeasedTensors
from embcache.clients._sync.client import EmbCacheClient
from embcache.clients._sync.results import LeasedTensors
from embcache.clients.core.errors import RpcFailed
from embcache.clients.core.replies import EntryBytes

__all__ = [
    "AsyncEmbCacheClient",
    "AsyncLeasedTensors",
    "EmbCacheClient",
    "EntryBytes",
    "LeasedTensors",
    "RpcFailed",
]
