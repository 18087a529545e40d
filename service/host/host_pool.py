"""The host page pool: one POSIX shared-memory segment, split into fixed-size pages.

The same segment serves both tiers of readers: CPU clients on the node map it by name
(zero-copy gets), and on a CUDA machine it is registered with the driver
(``cudaHostRegister``, portable + mapped), so GPUs copy from it at link speed
(docs/facts.md, "One shared-memory segment as the pinned host pool").

An exclusive ``flock`` on the segment marks it as owned by a live daemon, from the moment
its name appears: a segment is created under a hidden name, locked, and only then linked
to its own name, so no other daemon ever finds it unlocked while its owner lives. A
segment whose lock is free was left behind (by a daemon that died, or kept by a clean stop
for a warm restart) and is replaced or removed at start, whatever its age; one whose lock
is held belongs to a running daemon, and starting a second daemon on it fails. No lock file
is made: the segment is its own lock.

A warm restart (``docs/restart.md``) passes ``keep``: a stale segment that ``keep`` accepts
is adopted as it is (its bytes stay; ``adopted`` says so) instead of being replaced, and
:meth:`HostPool.close` with ``unlink=False`` leaves it for the next daemon.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from embcache.service.host.allocator import page_byte_runs
from embcache.service.host.shm_files import UntrustedFile, clear_own

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
_NAME_TRIES = 8  # fresh random names tried before giving up
# Files beside a segment: pool_index.py's warm-restart index, read_table.py's table.
INDEX_SUFFIXES = (".index", ".index.tmp", ".reads")
_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,200}$")


# Given an existing segment's stat, None to adopt it, or why it must be replaced.
KeepSegment = Callable[[os.stat_result], str | None]


class PoolInUseError(RuntimeError):
    """Another live daemon owns the shared-memory segment."""


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    """The host pool's segment: what clients need to map it, and its bytes for adapters
    that copy straight into reserved runs or out of leased ones (the shared tier)."""

    pool_id: str  # fresh for every pool: clients tell a new daemon's segment apart
    name: str
    path: Path
    nbytes: int
    page_bytes: int
    registered: bool  # registered with CUDA (pinned and mapped)
    array: np.ndarray = field(repr=False, compare=False)


class HostPool:
    """The segment, mapped here as ``array``/``tensor`` (module docstring).

    ``register_cuda``: pin it for the GPUs (slow for a large pool, so readiness waits for
    it); ``populate``: fault every page in now, not on a get's path; ``mode``: who may map it.
    Raises PoolInUseError when a live daemon owns the name."""

    def __init__(
        self,
        name: str,
        nbytes: int,
        page_bytes: int,
        *,
        register_cuda: bool = False,
        populate: bool = True,
        mode: int = 0o600,
        exclusive: bool = False,
        keep: KeepSegment | None = None,
    ) -> None:
        """Create the segment ``/dev/shm/<name>`` (``exclusive``: FileExistsError if the name
        exists; else a stale one of this user that no daemon holds is replaced, or adopted
        when ``keep`` accepts it)."""
        if not _NAME_RE.match(name):
            raise ValueError(f"shm name {name!r} must match {_NAME_RE.pattern}")
        assert nbytes > 0 and nbytes % page_bytes == 0, (nbytes, page_bytes)
        self.name = name
        self.pool_id = f"host-{secrets.token_hex(8)}"
        self.nbytes = nbytes
        self.page_bytes = page_bytes
        self.num_pages = nbytes // page_bytes
        self.path = SHM_DIR / name
        self.registered = False
        self.adopted = False  # the bytes of a stale segment were kept (warm restart)
        self.replaced_because: str | None = None  # why a stale segment was not adopted
        self._closed = False
        self._mode = mode
        self._keep = keep
        self._fd = self._create_segment(exclusive)
        try:
            # An adopted segment's pages exist already: its checksum pass faults them in.
            populate = populate and not self.adopted
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
            self._mmap = mmap.mmap(self._fd, nbytes, flags=flags)
            self.array: np.ndarray = np.frombuffer(self._mmap, dtype=np.uint8)
            self.tensor: torch.Tensor = torch.from_numpy(self.array)
            self.rows = self.tensor.view(-1, 16)  # the view 16-byte-row copy plans use
            if register_cuda:
                self._register_cuda()
        except BaseException:
            self._release_segment()
            raise

    # -- segment life cycle --------------------------------------------------------------
    def _create_segment(self, exclusive: bool) -> int:
        fd = _link_locked(self.path)
        if fd is None:
            if exclusive:
                raise FileExistsError(errno.EEXIST, "segment exists", str(self.path))
            fd = self._reclaim_stale()
            if self.adopted:
                os.fchmod(fd, self._mode)
                return fd  # locked, sized and full of the old daemon's bytes
        try:
            os.fchmod(fd, self._mode)  # explicit: the umask does not decide who may map it
            # fallocate reserves the tmpfs blocks now: a pool larger than /dev/shm fails
            # here with ENOSPC instead of with SIGBUS on first touch.
            os.posix_fallocate(fd, 0, self.nbytes)
        except OSError as exc:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            if exc.errno == errno.ENOSPC:
                raise OSError(
                    exc.errno,
                    f"no room for a {self.nbytes}-byte host pool in {SHM_DIR}: lower "
                    f"--host-pool-bytes or enlarge {SHM_DIR}",
                ) from None
            raise
        return fd

    def _reclaim_stale(self) -> int:
        """The segment exists already: replace it if it is ours and no daemon holds it."""
        fd = _open_own(self.path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise PoolInUseError(
                f"shared-memory segment {self.name!r} belongs to a running daemon: stop it, "
                "or give this one another --shm-name (or --grpc-port)"
            ) from None
        if self._keep is not None:
            st = os.fstat(fd)
            reason = self._keep(st)
            if reason is None and st.st_size != self.nbytes:
                reason = f"its size is {st.st_size} bytes, not {self.nbytes}"
            if reason is None:
                self.adopted = True
                log.info("adopting shared-memory segment %s (warm restart)", self.name)
                return fd
            self.replaced_because = reason
            log.warning(
                "replacing shared-memory segment %s instead of adopting it: %s",
                self.name,
                reason,
            )
        else:
            log.warning("replacing shared-memory segment %s: %s", self.name, left_by(self.path))
        _unlink_segment(self.path)
        os.close(fd)
        new = _link_locked(self.path)
        if new is None:  # another daemon took the name in between
            raise PoolInUseError(
                f"shared-memory segment {self.name!r} was just taken by another daemon: stop "
                "it, or give this one another --shm-name (or --grpc-port)"
            )
        return new

    def _register_cuda(self) -> None:
        from embcache.kernels import register_host_memory

        # Portable + mapped: every GPU can DMA from it and kernels can read it through UVA.
        self._registration = register_host_memory(self.tensor)
        self.registered = True

    def _release_segment(self, unlink: bool = True) -> None:
        if self.registered:
            torch.cuda.synchronize()  # no copy may still read the pages
            self._registration.unregister()
            self.registered = False
        for attr in ("rows", "tensor", "array"):
            if hasattr(self, attr):
                delattr(self, attr)
        if hasattr(self, "_mmap"):
            try:
                self._mmap.close()
            except BufferError:
                # Views handed out are still alive; the mapping goes when they do.
                log.debug("host pool mapping still referenced; leaving it to the GC")
        if unlink:
            self.path.unlink(missing_ok=True)
        os.close(self._fd)  # the flock goes with it: the next daemon may adopt the segment

    def close(self, *, unlink: bool = True) -> None:
        """Unregister, unmap and unlink the segment (``unlink=False``: leave it, for a warm
        restart). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._release_segment(unlink)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self._closed

    # -- access --------------------------------------------------------------------------
    def fileno(self) -> int:
        """The segment's file descriptor (it holds the flock)."""
        return self._fd

    def info(self) -> SegmentInfo:
        """What clients need to map the segment (and adapters to reach its bytes)."""
        return SegmentInfo(
            self.pool_id,
            self.name,
            self.path,
            self.nbytes,
            self.page_bytes,
            self.registered,
            self.array,
        )

    def byte_runs(self, runs: Sequence[tuple[int, int]], nbytes: int) -> list[tuple[int, int]]:
        """Byte ranges ``(offset, length)`` that hold the first ``nbytes`` of page runs."""
        return page_byte_runs(runs, self.page_bytes, nbytes)


def _link_locked(path: Path) -> int | None:
    """A new, empty segment at ``path``, locked before its name exists (module docstring);
    None when ``path`` exists. The hidden name never matches a ``<prefix>-*`` glob."""
    hidden = path.with_name(f".{path.name}.{secrets.token_hex(4)}.new")
    fd = os.open(hidden, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new inode: nobody else holds it
        os.link(hidden, path)  # atomic, and fails if the name exists
    except FileExistsError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    finally:
        hidden.unlink(missing_ok=True)
    return fd


def left_by(path: Path) -> str:
    """Who left an unlocked segment: a clean stop keeps its warm-restart index beside it;
    without one, its daemon died (or was killed) before removing it."""
    if path.with_name(path.name + INDEX_SUFFIXES[0]).exists():
        return "left with its index by a daemon that stopped (kept for a warm restart)"
    return "left by a daemon that did not stop cleanly"


def _unlink_segment(path: Path) -> None:
    """Remove a segment and the files beside it (its index, its read table) that this user
    owns: a file another local user put at one of those names is never removed or reused
    (``shm_files``)."""
    path.unlink(missing_ok=True)
    for suffix in INDEX_SUFFIXES:
        try:
            clear_own(path.with_name(path.name + suffix))
        except UntrustedFile as exc:
            log.warning("leaving %s", exc)


def _open_own(path: Path) -> int:
    """Open an existing segment for reclaiming; PoolInUseError if it is another user's (a
    name another local user took first is never adopted or replaced)."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        raise PoolInUseError(f"shared-memory segment {path.name!r} vanished; try again") from None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        raise PoolInUseError(
            f"shared-memory segment {path.name!r} exists and belongs to uid {st.st_uid}, not to "
            "this daemon's user: give this daemon another --shm-name (or leave it empty)"
        )
    return os.open(path, os.O_RDWR | os.O_NOFOLLOW)


def unique_host_pool(prefix: str, nbytes: int, page_bytes: int, **options: Any) -> HostPool:
    """A host pool in a new segment named ``<prefix>-<random>``, created exclusively: a name
    nobody can take first, and two daemons never share one. Segments of this prefix that
    this user's dead daemons left behind are removed first."""
    remove_stale_segments(prefix)
    for _ in range(_NAME_TRIES):
        name = f"{prefix}-{secrets.token_hex(4)}"
        try:
            return HostPool(name, nbytes, page_bytes, exclusive=True, **options)
        except FileExistsError:
            continue
    raise PoolInUseError(f"no free shared-memory name with prefix {prefix!r}; try again")


def unheld_segment(path: Path) -> os.stat_result | None:
    """``path``'s stat when it is a regular file of this user that no live daemon holds (a
    daemon's flock is taken before its segment's name exists and goes only with it);
    None otherwise."""
    try:
        st = path.lstat()
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return None
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return None  # a running daemon's
    finally:
        os.close(fd)
    return st


def remove_stale_segments(prefix: str) -> int:
    """Remove ``<prefix>-*`` segments of this user that no live daemon holds (their lock is
    free: module docstring), with the files beside them; returns how many went."""
    removed = 0
    for path in sorted(SHM_DIR.glob(f"{prefix}-*")):
        if path.name.endswith(INDEX_SUFFIXES):
            continue  # a segment's warm-restart index, not a segment (removed with it)
        if unheld_segment(path) is None:
            continue
        log.warning("removing shared-memory segment %s, %s", path.name, left_by(path))
        _unlink_segment(path)
        removed += 1
    return removed
