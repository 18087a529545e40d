"""The seam between the sync and async clients: the I/O each does its own way.

``_async`` is written once and ``_sync`` is generated from it by token replacement
(``scripts/unasync.py``): ``async``/``await`` go, ``AsyncX`` becomes ``X`` and ``async_x``
becomes ``sync_x``. So each name the client imports from here comes in two hand-written
flavours, one module each:

- ``async_io`` / ``sync_io``: the lock, the sleep between retries, the gRPC channel
  (``grpc.aio`` or ``grpc``), the call and release signatures, and what ``get`` returns.
- ``async_session`` / ``sync_session``: a gRPC Session stream, read by a task or a thread.
- ``async_socket_session`` / ``sync_socket_session``: a session on the daemon's session
  socket, read by a task or by the callers themselves (no thread: a result reaches its
  caller without a hop).

The two flavours of a session differ by design, not by ``await``; both carry the same calls
and results (``core.session_calls``).
"""
