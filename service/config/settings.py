"""The daemon's settings object: the field groups joined into one frozen ``Settings``.

Each group (``pools``, ``limits``, ``listeners``, ``runtime``) holds its fields and the checks
that need only them; this class adds what spans groups: old names, the checks across
fields, and the values derived from several of them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from embcache.service.config.aliases import apply_renames
from embcache.service.config.forms import is_loopback
from embcache.service.config.limits import LimitSettings
from embcache.service.config.listeners import ListenerSettings
from embcache.service.config.pools import PoolSettings
from embcache.service.config.runtime import RuntimeSettings
from embcache.service.config.views import DeviceConfig


# pydantic lists the fields of the bases from the last base to the first, so the groups are
# named here in reverse: the fields (and the flags of ``--help``) come pools first.
class Settings(RuntimeSettings, ListenerSettings, LimitSettings, PoolSettings, BaseSettings):
    """Everything the daemon can be told. Env var ``EMBCACHE_<FIELD>`` or flag ``--<field>``."""

    model_config = SettingsConfigDict(
        env_prefix="EMBCACHE_", frozen=True, extra="forbid", validate_default=True
    )

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        """Settings under their old names (arguments or ``EMBCACHE_<OLD>`` env vars) still
        work for one release, with a log line naming the new one."""
        if not isinstance(data, dict):
            return data
        return apply_renames(data)

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if self.host_pool_bytes % self.page_bytes:
            raise ValueError(
                f"host_pool_bytes ({self.host_pool_bytes}) must be a multiple of "
                f"page_bytes ({self.page_bytes})"
            )
        if self.host_pool_bytes < self.page_bytes:
            raise ValueError("host_pool_bytes must hold at least one page")
        if self.device_pool_bytes % self.device_page_bytes:
            raise ValueError("device_pool_bytes must be a multiple of device_page_bytes")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca (mTLS) needs tls_cert and tls_key")
        exposed = [
            f"{name}={host}"
            for name, host in (("grpc_host", self.grpc_host), ("http_host", self.http_host))
            if not is_loopback(host)
        ]
        if exposed and not self.auth_token and self.tls_client_ca is None:
            raise ValueError(
                f"non-loopback bind ({', '.join(exposed)}) needs auth_token, or mTLS "
                "(tls_cert, tls_key and tls_client_ca): TLS alone encrypts but lets anyone in"
            )
        return self

    @property
    def shm_prefix(self) -> str:
        """Segments without a ``shm_name`` are ``<this>-<random>`` (``unique_host_pool``)."""
        return f"embcache-{self.grpc_port}"

    @property
    def effective_ipc_socket(self) -> Path:
        """The fd socket's path: ``ipc_socket``, else beside the gRPC socket, else in /tmp."""
        if self.ipc_socket is not None:
            return self.ipc_socket
        if self.grpc_socket is not None:
            return self.grpc_socket.with_name(self.grpc_socket.name + ".fds")
        return Path(f"/tmp/embcache-{self.grpc_port}.fds")

    @property
    def num_host_pages(self) -> int:
        """Pages in the host pool."""
        return self.host_pool_bytes // self.page_bytes

    @property
    def inflight_limit(self) -> int:
        """Bytes one owner may hold in unfinished puts (0 in the settings: the pool size)."""
        return self.max_inflight_bytes_per_client or self.host_pool_bytes

    @property
    def entry_limit(self) -> int:
        """Most entries (0 in the settings: one per host page, plus 1024 zero-byte ones)."""
        return self.max_entries or self.num_host_pages + 1024

    @property
    def leased_bytes_limit(self) -> int:
        """Bytes one owner may hold leased (0 in the settings: half the host pool, and never
        less than the largest entry the pool takes, so any entry can be read)."""
        largest = min(self.max_entry_bytes, self.host_pool_bytes)
        return self.max_leased_bytes_per_owner or max(self.host_pool_bytes // 2, largest)

    @property
    def quarantine_limit(self) -> int:
        """Bytes one process may keep quarantined (0 in the settings: a quarter of the pool)."""
        return self.max_quarantine_bytes_per_owner or self.host_pool_bytes // 4

    def device_config(self) -> DeviceConfig:
        """The settings the device tier needs, and no others."""
        return DeviceConfig(
            copy_backend=self.copy_backend,
            sm_budget=self.copy_sm_budget,
            free_reserve=self.device_free_reserve,
            table_flush_s=self.device_table_flush_s,
        )
