"""How transports report each finished call (``Metrics.observe_rpc``) and what they refuse
or drop, for the metrics."""

from __future__ import annotations

from typing import Protocol


class RpcMetrics(Protocol):
    """What a transport reports to: ``Metrics``, or a fake in tests."""

    def observe_rpc(self, transport: str, method: str, code: str, seconds: float) -> None: ...

    def observe_refusal(self, listener: str, reason: str) -> None:
        """A session-socket connection refused or closed before its session opened."""

    def observe_dropped_touch(self) -> None:
        """A session's touch dropped by its rate limit (``max_touch_keys_per_s``)."""
