"""What the sync and async clients share and write once, with no I/O of its own.

Building requests and reading replies, payload encoding, targets and channel options, the
error classes rebuilt from a status, the retry policy, and what the daemon (or this process)
turned out not to support. The clients' I/O lives in ``_async`` (and the ``_sync`` generated
from it) and in the flavoured backends of ``_backends``.
"""
