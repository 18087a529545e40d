"""The runtime settings: copy kernels, the shared tier and logging.

A group of fields that ``Settings`` is assembled from, with the check of the shared tier's
URL (its adapter parses it, so a bad one is refused at start-up, not at the first put).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator

from embcache.service.tier_config import SharedTierConfig


class RuntimeSettings(BaseModel):
    """The device and copy backend, the shared tier and the logs (part of ``Settings``; every
    field is ``EMBCACHE_<FIELD>`` or ``--<field>``)."""

    # Kernels / devices
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="'auto' uses CUDA when present, else CPU mode."
    )
    copy_sm_budget: int = Field(
        16, ge=1, le=1024, description="Most programs the copy kernel may run at once."
    )
    copy_backend: Literal["auto", "kernel", "batch", "memcpy", "torch"] = Field(
        "auto", description="transfer_ranges backend: auto, kernel, batch, memcpy, torch."
    )
    # Shared tier (service/shared_tier/; docs/scale-out.md)
    shared_tier: str | None = Field(
        None,
        description="Shared tier URL: redis://host:port[,host:port...][/db] | rediss://... | "
        "mooncake://master:port; adapter options in the query string. None: off.",
    )
    shared_tier_ack: Literal["async", "sync"] = Field(
        "async", description="sync: a put returns once the shared tier has the entry."
    )
    shared_tier_queue: int = Field(1024, ge=1, description="Write-through queue length (entries).")
    shared_tier_timeout_s: float = Field(
        2.0,
        gt=0,
        description="Per shared-tier operation; also the longest a put waits on a full "
        "write-through queue.",
    )
    shared_tier_retries: int = Field(
        3, ge=0, description="Write-through retries before an entry is left out of the tier."
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Log level."
    )
    log_format: Literal["text", "json"] = Field(
        "text",
        description="Format of the log lines on stderr, uvicorn's included: text, or json "
        "(one object a line: time, level, logger, message).",
    )

    @field_validator("shared_tier")
    @classmethod
    def _tier_url(cls, v: str | None) -> str | None:
        if v:
            SharedTierConfig.from_url(v)  # raises ValueError naming what is wrong
        return v or None
