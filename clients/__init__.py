"""Python client library of embcache (sync and asyncio).

``EmbCacheClient(target)`` / ``AsyncEmbCacheClient(target)``; targets are ``unix:/path`` or
``host:port``. See docs/grpc.md.
"""

from embcache.clients.async_client import AsyncEmbCacheClient
from embcache.clients.core.errors import RpcFailed
from embcache.clients.core.replies import EntryBytes
from embcache.clients.results import AsyncLeasedTensors, LeasedTensors
from embcache.clients.sync_client import EmbCacheClient

__all__ = [
    "AsyncEmbCacheClient",
    "AsyncLeasedTensors",
    "EmbCacheClient",
    "EntryBytes",
    "LeasedTensors",
    "RpcFailed",
]
