"""Files beside the segment: created exclusively and privately, another user's refused
(never removed, written or read), a symlink never followed, an others-writable one never
trusted. The tests run as root: "another user" is uid 65534."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from embcache.service.host.shm_files import (
    UntrustedFile,
    create_exclusive,
    open_trusted,
    read_trusted,
)

OTHER = 65534

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


def planted(path: Path, uid: int = OTHER, mode: int = 0o666) -> Path:
    path.write_bytes(b"planted")
    os.chown(path, uid, uid)
    os.chmod(path, mode)
    return path


def test_a_new_file_is_private_and_a_stale_own_one_is_replaced(tmp_path: Path) -> None:
    path = planted(tmp_path / "x.index", uid=os.geteuid(), mode=0o644)
    fd = create_exclusive(path, 0o600)
    os.close(fd)
    st = path.stat()
    assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o600
    assert path.read_bytes() == b""


def test_another_users_file_or_symlink_is_refused_and_left_alone(tmp_path: Path) -> None:
    path = planted(tmp_path / "x.index")
    with pytest.raises(UntrustedFile):
        create_exclusive(path)
    assert path.read_bytes() == b"planted" and path.stat().st_uid == OTHER
    link = tmp_path / "y.index"
    victim = planted(tmp_path / "victim", uid=os.geteuid(), mode=0o600)
    link.symlink_to(victim)
    os.lchown(link, OTHER, OTHER)
    with pytest.raises(UntrustedFile):
        create_exclusive(link)
    assert victim.read_bytes() == b"planted"


@pytest.mark.parametrize(
    "uid, mode", [(OTHER, 0o600), (0, 0o666), (0, 0o620)], ids=["other uid", "world", "group"]
)
def test_a_file_the_daemon_cannot_trust_is_not_read(tmp_path: Path, uid: int, mode: int) -> None:
    path = planted(tmp_path / "x.index", uid=uid, mode=mode)
    with pytest.raises(UntrustedFile):
        read_trusted(path)


def test_a_symlink_is_never_followed_on_read(tmp_path: Path) -> None:
    target = tmp_path / "real"
    target.write_bytes(b"ours")
    target.chmod(0o600)
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(UntrustedFile):
        open_trusted(tmp_path / "link")
    assert read_trusted(target) == b"ours"
    with pytest.raises(FileNotFoundError):
        read_trusted(tmp_path / "missing")


def test_a_tmp_planted_while_running_stops_the_index_and_removes_it(tmp_path: Path) -> None:
    from embcache.service.host import index_records as rec
    from embcache.service.host.pool_index import PoolIndex

    path = tmp_path / "x.index"
    index = PoolIndex.create(path, rec.Header(rec.LAYOUT_VERSION, 4096, 256, 7, 3))
    assert index.active and path.exists()
    tmp = planted(tmp_path / "x.index.tmp")
    index._rewrite()  # a compaction: the temporary's name is another user's now
    assert not index.active and index.refused == 1
    assert not path.exists()  # no stale index left to lie to the next start
    assert tmp.read_bytes() == b"planted" and tmp.stat().st_uid == OTHER
