"""How transports report each finished call, for the metrics (``Metrics.observe_rpc``)."""

from __future__ import annotations

from typing import Protocol


class RpcMetrics(Protocol):
    def observe_rpc(self, transport: str, method: str, code: str, seconds: float) -> None: ...
