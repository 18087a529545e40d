from __future__ import annotations

import fcntl
import os
import subprocess
import sys

import pytest

from embcache.service.host.host_pool import SHM_DIR, HostPool, PoolInUseError

READER = """
import mmap, sys
with open('/dev/shm/' + sys.argv[1], 'rb') as f:
    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    sys.stdout.write(m[int(sys.argv[2]):int(sys.argv[2]) + 5].hex())
"""


def test_segment_shared_with_other_process(shm_name: str) -> None:
    pool = HostPool(shm_name, 1 << 20, 4096)
    try:
        assert (SHM_DIR / shm_name).exists()
        assert pool.num_pages == 256 and pool.tensor.numel() == 1 << 20
        pool.array[8192:8197] = [1, 2, 3, 4, 255]
        out = subprocess.run(
            [sys.executable, "-c", READER, shm_name, "8192"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert out == "01020304ff"
        assert not pool.registered
    finally:
        pool.close()
    assert not (SHM_DIR / shm_name).exists()
    pool.close()  # idempotent


def test_second_daemon_refused(shm_name: str) -> None:
    pool = HostPool(shm_name, 1 << 16, 4096)
    try:
        with pytest.raises(PoolInUseError):
            HostPool(shm_name, 1 << 16, 4096)
        assert (SHM_DIR / shm_name).exists()  # the owner's segment is untouched
    finally:
        pool.close()


def test_stale_segment_replaced(shm_name: str) -> None:
    path = SHM_DIR / shm_name
    path.write_bytes(b"x" * 100)  # left by a daemon that died: nobody holds its lock
    pool = HostPool(shm_name, 1 << 16, 4096)
    try:
        assert path.stat().st_size == 1 << 16
        fd = os.open(path, os.O_RDWR)
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(fd)
    finally:
        pool.close()


def test_bad_name_and_byte_runs(shm_name: str) -> None:
    with pytest.raises(ValueError, match="shm name"):
        HostPool("../etc/passwd", 4096, 4096)
    pool = HostPool(shm_name, 8 * 4096, 4096)
    try:
        assert pool.byte_runs(((0, 2), (5, 1)), 4096 + 100) == [(0, 4196)]
        assert pool.byte_runs(((0, 1), (5, 2)), 4096 + 5000) == [(0, 4096), (20480, 5000)]
    finally:
        pool.close()


def test_segment_mode(shm_name: str) -> None:
    import stat

    pool = HostPool(shm_name, 1 << 16, 4096, mode=0o640)
    try:
        assert stat.S_IMODE((SHM_DIR / shm_name).stat().st_mode) == 0o640
    finally:
        pool.close()
