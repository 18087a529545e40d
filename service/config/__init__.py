"""Daemon settings: one frozen object built from env vars (``EMBCACHE_*``) and CLI flags.

Sizes accept plain integers or values like ``4GiB``, ``256KiB``, ``1.5GB``. The fields come
in groups, a module each (``pools``, ``limits``, ``listeners``, ``runtime``), joined in
``settings``; the names below are what the rest of the daemon imports.
"""

from __future__ import annotations

from embcache.service.config.aliases import DEPRECATED_NAMES
from embcache.service.config.forms import SHM_NAME, ByteSize, is_loopback
from embcache.service.config.settings import Settings
from embcache.service.config.views import DeviceConfig
from embcache.service.sizes import parse_cpu_list, parse_size

__all__ = [
    "DEPRECATED_NAMES",
    "SHM_NAME",
    "ByteSize",
    "DeviceConfig",
    "Settings",
    "is_loopback",
    "parse_cpu_list",
    "parse_size",
]
