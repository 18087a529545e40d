"""``EmbCacheClient.pin``: leases and each entry's dtype and shape, no bytes, no mapping
(the vLLM scheduler's lookup), over the session socket and over TCP."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import torch

from embcache.clients import EmbCacheClient


@pytest.mark.parametrize("over", ["unix", "tcp"])
def test_pin_leases_without_bytes(daemon: Any, client: Any, over: str) -> None:
    key, other = f"pin-{uuid.uuid4().hex}", f"pin-miss-{uuid.uuid4().hex}"
    client.put(key, torch.arange(24, dtype=torch.float32).reshape(4, 6).to(torch.bfloat16))
    target = daemon.unix_target if over == "unix" else daemon.grpc_target
    with EmbCacheClient(target) as c:
        pins = c.pin([key, other], ttl_s=30)
        assert pins[1] is None
        p = pins[0]
        assert p is not None and p.key == key
        assert (p.dtype, p.shape, p.nbytes) == ("bfloat16", (4, 6), 48) and p.lease_id
        assert client.evict([key]) == ["leased"]  # the pin holds it
        c.release([p.lease_id])
    assert client.evict([key]) == ["evicted"]
