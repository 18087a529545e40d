"""Files beside the segment, against real daemons: ``/dev/shm`` is writable by every local
user, so a file another user put at the name of the warm-restart index (or of its temporary,
or of the read table) first must never become the daemon's, be written through, or be
adopted. The tests run as root: "another user" is uid 65534 (chown), with mode 0666."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from relkit import daemon as dm
from relkit import figures, payload

from embcache.clients import EmbCacheClient
from embcache.service.host import index_records as rec
from embcache.service.host.pool_index import replay

OTHER = 65534  # nobody
NBYTES = 64 << 10
FIG: dict[str, object] = {}


@pytest.fixture
def spec(tmp_path: Path) -> Iterator[dm.DaemonSpec]:
    s = dm.DaemonSpec(tmp_path, pool="16MiB", warm_restart=True, drain_grace_s=1.0)
    yield s
    for suffix in ("", ".index", ".index.tmp", ".reads"):
        dm.SHM_DIR.joinpath(s.shm_name + suffix).unlink(missing_ok=True)


def beside(spec: dm.DaemonSpec, suffix: str) -> Path:
    return dm.SHM_DIR / (spec.shm_name + suffix)


def plant(path: Path, data: bytes, mode: int = 0o666, uid: int = OTHER) -> None:
    """A file of another user at ``path``: its owner and mode as that user would leave it."""
    path.unlink(missing_ok=True)
    path.write_bytes(data)
    os.chown(path, uid, uid)
    os.chmod(path, mode)


def doctored_index(spec: dm.DaemonSpec) -> bytes:
    """The daemon's index with two framed, checksummed records appended: ``k1`` goes and
    ``k0`` points at k1's pages (with k1's CRC32, so the bytes pass their check)."""
    path = beside(spec, ".index")
    k1 = replay(path).adds["k1"]
    evil = rec.AddRecord("k0", k1.dtype, k1.shape, k1.nbytes, k1.runs, k1.crc, k1.generation)
    return path.read_bytes() + rec.encode_del("k1") + rec.encode_add(evil)


def put_and_stop(spec: dm.DaemonSpec) -> None:
    with dm.running(spec) as d, EmbCacheClient(d.unix, timeout=10) as client:
        for i in range(2):
            client.put(f"k{i}", payload.make(f"k{i}", NBYTES, i))


def k0_problem(d: dm.Daemon) -> str | None:
    with EmbCacheClient(d.unix, timeout=10) as client, client.get(["k0"]) as (got,):
        problem = None if got is None else payload.check("k0", got)
        del got
    return problem


@pytest.mark.parametrize("how", ["file of another user", "symlink", "world-writable"])
def test_an_index_the_daemon_did_not_write_is_never_adopted(
    spec: dm.DaemonSpec, tmp_path: Path, how: str
) -> None:
    put_and_stop(spec)
    index = beside(spec, ".index")
    data = doctored_index(spec)
    if how == "file of another user":
        plant(index, data)
    elif how == "symlink":  # another user's link to another user's file
        target = tmp_path / "evil.index"
        plant(target, data, mode=0o644)
        index.unlink()
        index.symlink_to(target)
        os.lchown(index, OTHER, OTHER)
    else:  # the daemon's own uid, but anyone may append to it
        plant(index, data, uid=os.geteuid())
    with dm.running(spec) as d:
        assert k0_problem(d) is None, "k0 served another entry's bytes"
        restart = d.stats()["restart"]
        assert restart["adopted_entries"] == 0, restart
        assert restart["untrusted_index"] == 1, restart
        assert "refusing the index" in d.log_tail(20000)
        st = index.lstat()
        if how == "world-writable":  # the daemon's own name: replaced by a private index
            assert stat.S_ISREG(st.st_mode) and st.st_mode & 0o777 == 0o600, oct(st.st_mode)
            assert index.read_bytes() != data
        else:  # another user's: neither replaced nor written through
            assert st.st_uid == OTHER and index.read_bytes() == data
    FIG[f"index planted ({how})"] = "refused, cold start, counted"


def test_a_tmp_file_planted_by_another_user_never_becomes_the_index(
    spec: dm.DaemonSpec,
) -> None:
    tmp = beside(spec, ".index.tmp")
    plant(tmp, b"planted")
    with dm.running(spec) as d:
        with EmbCacheClient(d.unix, timeout=10) as client:
            client.put("k", payload.make("k", NBYTES, 7))
        index = beside(spec, ".index")
        if index.exists():  # never the planted file, and never another user's
            st = index.lstat()
            assert st.st_uid == os.geteuid() and st.st_mode & 0o777 == 0o600, st
        assert tmp.read_bytes() == b"planted"  # not written through
        assert tmp.stat().st_uid == OTHER
        assert d.stats()["restart"]["untrusted_index"] == 1
    FIG["index.tmp planted by another user"] = "refused: no index kept, nothing written"


def test_a_read_table_planted_by_another_user_is_not_written(spec: dm.DaemonSpec) -> None:
    spec.warm_restart = False
    reads = beside(spec, ".reads")
    plant(reads, b"\0" * 4096)
    with dm.running(spec) as d:
        with EmbCacheClient(d.unix, timeout=10) as client:
            client.put("k", payload.make("k", NBYTES, 3))
            with client.get(["k"]) as (got,):  # gets still work, by calls
                assert payload.check("k", got) is None
            del got
        assert reads.read_bytes() == b"\0" * 4096 and reads.stat().st_uid == OTHER
    FIG["read table planted by another user"] = "refused: gets are calls"


def test_zz_figures() -> None:
    print("\n" + figures.table("files beside the segment (CI)", FIG))
    figures.save("shm_files", FIG)
