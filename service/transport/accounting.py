"""How transports report each finished call, for the metrics (``Metrics.observe_rpc``)."""

from __future__ import annotations

from typing import Protocol


class RpcMetrics(Protocol):
    """What a transport reports to: ``Metrics``, or a fake in tests."""

    def observe_rpc(self, transport: str, method: str, code: str, seconds: float) -> None: ...
