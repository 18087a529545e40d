"""The views of the settings handed inward: each layer below gets the few values it needs.

The device tier takes a :class:`DeviceConfig` instead of ``Settings`` so that it can be built
and tested without the daemon's whole configuration.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class DeviceConfig:
    """The device tier's view of the settings (``Settings.device_config``)."""

    copy_backend: Literal["auto", "kernel", "batch", "memcpy", "torch"]  # or forced
    sm_budget: int  # most programs a copy kernel runs with
    free_reserve: float  # share of each pool kept free after cold gets
    table_flush_s: float  # longest page-table updates wait to be launched together
