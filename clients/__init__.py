"""Python client library of embcache (sync and asyncio).

``EmbCacheClient(target)`` / ``AsyncEmbCacheClient(target)``; targets are ``unix:/path`` or
``host:port``. See docs/grpc.md.
"""

from ._wire import EntryBytes
from .async_client import AsyncEmbCacheClient
from .errors import RpcFailed
from .results import AsyncLeasedTensors, LeasedTensors
from .sync_client import EmbCacheClient

__all__ = [
    "AsyncEmbCacheClient",
    "AsyncLeasedTensors",
    "EmbCacheClient",
    "EntryBytes",
    "LeasedTensors",
    "RpcFailed",
]
