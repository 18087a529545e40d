"""What this client stopped asking of the daemon, because the daemon (or this process) showed
it could not, and so asking again would only fail the same way and cost a round trip.

Device puts, batched device puts and ready events turn off for the client's life; a GPU whose
device path failed is served through the host for a while, then tried again (a restarted
daemon, a pool back in service).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from embcache.clients.core.errors import RpcFailed
from embcache.errors import DeviceUnavailable

log = logging.getLogger("embcache.client")


@dataclass
class Capabilities:
    """Which of the daemon's optional paths this client still uses (all until one fails)."""

    device_puts: bool = True  # PutFromDevice; off once the daemon cannot read this GPU
    batch_puts: bool = True  # PutFromDeviceBatch; off once the daemon says it lacks it
    ready_events: bool = True  # device Gets ask for a ready event; off once one failed here
    writable_puts: bool = True  # host puts go into stashes; off once mapping failed

    def put_failed(self, exc: Exception) -> bool:
        """After a failed device put: True when the tensors should be put another way (and
        this is remembered for later calls); False: the caller raises ``exc``."""
        if isinstance(exc, DeviceUnavailable):
            log.info("daemon cannot read this GPU's memory (%s); streaming bytes", exc)
            self.device_puts = False
            return True
        if isinstance(exc, RpcFailed) and exc.code == "UNIMPLEMENTED":
            log.info("daemon has no PutFromDeviceBatch; putting one by one")
            self.batch_puts = False
            return True
        return False

    def events_failed(self, exc: Exception) -> None:
        """A reply's ready event could not be opened in this process: later device Gets ask
        the daemon to finish its copies before it replies."""
        log.info("%s; the daemon will finish copies before replying", exc)
        self.ready_events = False


class HostFallbacks:
    """GPUs (by uuid) whose device path failed in this client, so gets for them copy
    through the host for a while: ``retry_s`` later the device path is tried again (a
    restarted daemon, a pool back in service). Each fallback is logged as a warning."""

    def __init__(self, retry_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.retry_s = retry_s
        self._clock = clock
        self._until: dict[str, float] = {}

    def add(self, uuid: str, reason: object) -> None:
        log.warning("GPU %s: %s; copying through the host for %.0f s", uuid, reason, self.retry_s)
        self._until[uuid] = self._clock() + self.retry_s

    def __contains__(self, uuid: object) -> bool:
        until = self._until.get(uuid)  # type: ignore[call-overload]
        if until is None:
            return False
        if self._clock() >= until:
            self._until.pop(uuid, None)  # type: ignore[call-overload]
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        return iter([u for u in list(self._until) if u in self])

    def __len__(self) -> int:
        return sum(1 for _ in self)
