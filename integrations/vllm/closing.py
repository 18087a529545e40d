"""Closing a client without waiting on its daemon.

Closing ends the client's session, which may wait on the daemon; after a failed call the
daemon may be the thing that hangs. The connector's threads drop such a client and close
it on a thread of its own, so a hung daemon never holds a lookup, a staging or a save.
"""

from __future__ import annotations

import logging
import threading

from embcache.clients import EmbCacheClient

log = logging.getLogger("embcache.integrations.vllm")


def close_in_background(client: EmbCacheClient | None, what: str) -> None:
    """Close ``client`` on a daemon thread (nothing to do for None)."""
    if client is None:
        return

    def run() -> None:
        try:
            client.close()
        except Exception as exc:  # a client that cannot even close is gone all the same
            log.debug("embcache %s client close: %s", what, exc)

    threading.Thread(target=run, name=f"embcache-close-{what}", daemon=True).start()
