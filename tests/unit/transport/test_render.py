"""gRPC's PoolHandle messages are the describer's pool descriptions, field for field, and
the client reads them back into the same description."""

from __future__ import annotations

import pytest

from embcache.clients.device.device_replies import pool_handle
from embcache.proto.locations import DevicePoolDesc, HostShmPool
from embcache.service.transport.handlers.device import pool_handle_of

COMMON = {"pool_id": "dev0-x", "gpu_uuid": "GPU-1", "size": 1 << 30, "page_bytes": 1 << 18}


@pytest.mark.parametrize(
    "desc",
    [
        DevicePoolDesc(**COMMON, ipc_mode="legacy", ipc_handle=bytes(range(64))),
        DevicePoolDesc(
            **COMMON,
            ipc_mode="fd",
            fd_token=7,
            alloc_size=(1 << 30) + 4096,
            fd_socket="/run/embcache/ipc.sock",
        ),
        DevicePoolDesc(**COMMON, ipc_mode="none"),
    ],
    ids=["legacy", "fd", "none"],
)
def test_device_pool_round_trip(desc: DevicePoolDesc) -> None:
    msg = pool_handle_of(desc)
    got = pool_handle(msg)
    assert (got.pool_id, got.gpu_uuid, got.page_bytes) == (desc.pool_id, desc.gpu_uuid,
                                                           desc.page_bytes)  # fmt: skip
    if desc.ipc_mode == "legacy":
        assert got.ipc_handle == desc.ipc_handle and got.nbytes == desc.size
    if desc.ipc_mode == "fd":
        assert (got.fd_socket, got.fd_token, got.nbytes) == ("/run/embcache/ipc.sock", 7,
                                                          desc.alloc_size)  # fmt: skip
    if desc.ipc_mode == "none":
        assert msg.device.WhichOneof("handle") is None


def test_host_pool() -> None:
    desc = HostShmPool("host-1", "embcache-x", 1 << 20, 4096, "boot", 5, 6)
    msg = pool_handle_of(desc)
    shm = msg.host_shm
    assert msg.pool_id == "host-1"
    assert (shm.segment_name, shm.size, shm.page_bytes, shm.boot_id, shm.st_dev, shm.st_ino) == (
        "embcache-x", 1 << 20, 4096, "boot", 5, 6)  # fmt: skip


def test_grpc_and_rest_name_the_host_pool_alike(shm_name: str) -> None:
    import torch

    from embcache.service.config import Settings
    from embcache.service.device.pool import DevicePool
    from embcache.service.engine import CacheEngine
    from embcache.service.transport.grpc.servicer import EmbeddingCacheServicer
    from embcache.service.transport.render import LocationRenderer

    settings = Settings(host_pool_bytes=16 * 4096, page_bytes=4096, shm_name=shm_name,
                        device="cpu")  # fmt: skip
    pool = DevicePool(torch.device("cpu"), 4 * 4096, 4096, ipc_mode="none")
    with CacheEngine(settings, device_pools=[pool]) as engine:
        servicer = EmbeddingCacheServicer(engine, settings)
        describer = LocationRenderer(engine, settings)
        assert servicer.host_pool.pool_id == describer.host_pool().pool_id
        assert servicer.device.pool_handle(pool).pool_id == describer.device_pool(pool).pool_id
        servicer.close()
