"""Who is at the other end of a Unix socket: the kernel's word (SO_PEERCRED)."""

from __future__ import annotations

import os
import socket

from embcache.service.transport.sockets import peer_credentials


def test_a_unix_socket_names_its_peer_process() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        peer = peer_credentials(a)
        assert peer is not None
        assert peer == (os.getpid(), os.getuid(), os.getgid())


def test_other_sockets_name_nobody() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
        assert peer_credentials(tcp) is None
    assert peer_credentials(None) is None
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.close()
    b.close()
    assert peer_credentials(a) is None  # closed: the kernel cannot say
