from __future__ import annotations

import pytest
import torch

from embcache.clients.results import LeasedTensors
from embcache.errors import LeaseExpired


def test_release_reports_leases_that_ended_early() -> None:
    t = [torch.zeros(2)]
    ok = LeasedTensors(t, [1, 2], lambda ids: 2)
    with ok as tensors:
        assert tensors is t
    assert ok.released
    stale = LeasedTensors(t, [1, 2], lambda ids: 1)  # one lease had expired: views were stale
    with pytest.raises(LeaseExpired) as info, stale:
        pass
    assert info.value.details == {"held": 2, "released": 1}
    stale.release()  # idempotent: the error is reported once

    # while another exception is leaving the block, it is not hidden by LeaseExpired
    with pytest.raises(KeyError), LeasedTensors(t, [1], lambda ids: 0):
        raise KeyError("boom")


def test_host_fallbacks_expire_so_the_device_path_is_tried_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from embcache.clients.core.capabilities import HostFallbacks

    now = [100.0]
    fb = HostFallbacks(retry_s=30.0, clock=lambda: now[0])
    assert "GPU-a" not in fb and not fb
    with caplog.at_level("WARNING"):
        fb.add("GPU-a", "device pool out of service")
    assert "out of service" in caplog.text and "30 s" in caplog.text
    now[0] = 129.9
    assert "GPU-a" in fb and list(fb) == ["GPU-a"] and "GPU-b" not in fb
    now[0] = 130.0  # a restarted daemon, or a pool back in service, gets its chance again
    assert "GPU-a" not in fb and len(fb) == 0
