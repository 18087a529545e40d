from __future__ import annotations

import pytest
import torch

from embcache.clients.results import LeasedTensors
from embcache.service.errors import LeaseExpired


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
