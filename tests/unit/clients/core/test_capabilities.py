"""What a client stops asking of the daemon (clients/core/capabilities.py)."""

from __future__ import annotations

import pytest

from embcache.clients.core.capabilities import Capabilities, HostFallbacks
from embcache.clients.core.errors import RpcFailed
from embcache.errors import DeviceUnavailable, InvalidArgument


def test_host_fallbacks_expire_so_the_device_path_is_tried_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
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


def test_a_failed_device_put_turns_off_what_the_daemon_lacks() -> None:
    caps = Capabilities()
    assert not caps.put_failed(InvalidArgument("bad key"))  # the caller raises it
    assert caps.device_puts and caps.batch_puts
    assert caps.put_failed(RpcFailed("no such method", "UNIMPLEMENTED"))  # an older daemon
    assert caps.device_puts and not caps.batch_puts
    assert caps.put_failed(DeviceUnavailable("CPU mode"))
    assert not caps.device_puts
    caps.events_failed(RuntimeError("another IPC namespace"))
    assert not caps.ready_events
