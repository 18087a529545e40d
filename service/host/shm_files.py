"""Files beside the host pool's segment, in a directory every local user may write.

``/dev/shm`` is world-writable (sticky): any local user may create a name there first, as a
file or as a symlink, and a file another user owns with a group- or world-writable mode can
be changed by that user at any time. So every file the daemon keeps beside its segment (the
warm-restart index and its temporary, the read table) is created here with ``O_CREAT |
O_EXCL | O_NOFOLLOW``, owned by the daemon's uid and with a mode that only the daemon can
write (:func:`create_exclusive`); what is at the name first is removed only when the daemon
owns it, and refused otherwise. A file read back at a start (:func:`open_trusted`) is used
only when the daemon's uid owns it, it is a regular file (never through a symlink), and
neither group nor others may write it.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path

log = logging.getLogger(__name__)

_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH


class UntrustedFile(OSError):
    """A file beside the segment that the daemon did not make for itself (another user's,
    a symlink, or writable by others): never read, written through, or adopted."""


def check_trusted(st: os.stat_result, path: Path) -> None:
    """UntrustedFile unless ``st`` (an ``lstat`` or ``fstat``) is a regular file owned by
    this process's effective uid that neither group nor others may write."""
    if not stat.S_ISREG(st.st_mode):
        raise UntrustedFile(f"{path.name} is not a regular file (a symlink, say)")
    if st.st_uid != os.geteuid():
        raise UntrustedFile(f"{path.name} belongs to uid {st.st_uid}, not {os.geteuid()}")
    if st.st_mode & _WRITABLE_BY_OTHERS:
        raise UntrustedFile(f"{path.name} may be written by others (mode {st.st_mode & 0o777:o})")


def clear_own(path: Path, *, remove: bool = True) -> None:
    """Remove what is at ``path`` if this uid owns it (a stale file of an earlier daemon, or
    a symlink of our own; ``remove=False``: only check); nothing if nothing is there.
    UntrustedFile, touching nothing, when another user owns it: neither removed nor used."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if st.st_uid != os.geteuid():
        raise UntrustedFile(
            f"{path.name} exists and belongs to uid {st.st_uid}: refusing to use or replace it"
        )
    if remove:
        path.unlink(missing_ok=True)


def create_exclusive(path: Path, mode: int = 0o600, flags: int = os.O_WRONLY) -> int:
    """A new file at ``path`` that this process created (``O_EXCL``: never one planted
    there, never through a symlink), owned by its uid, with exactly ``mode`` (``mode`` may
    let others read, never write). A stale one this uid owns is removed first; one of
    another user is refused (UntrustedFile). Returns the open descriptor."""
    assert not mode & _WRITABLE_BY_OTHERS, f"mode {mode:o} lets others write"
    clear_own(path)
    fd = os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)  # the umask may have narrowed it
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_trusted(path: Path, flags: int = os.O_RDONLY) -> int:
    """Open an existing file beside the segment that the daemon made (:func:`check_trusted`,
    on the open descriptor: no race with a rename); FileNotFoundError when there is none,
    UntrustedFile when it is not one the daemon may trust."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink at the name
            raise UntrustedFile(f"{path.name} is a symlink") from None
        raise
    try:
        check_trusted(os.fstat(fd), path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_trusted(path: Path) -> bytes:
    """The bytes of a file :func:`open_trusted` accepts."""
    fd = open_trusted(path)
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
