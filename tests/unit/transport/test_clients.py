"""Whose a call without a session is: its client, never its connection."""

from __future__ import annotations

import pytest

from embcache.service.transport.session.registry import SessionRegistry, client_of, peer_address


@pytest.mark.parametrize(
    ("peer", "address"),
    [
        ("ipv4:127.0.0.1:51234", "127.0.0.1"),
        ("ipv6:[::1]:51234", "::1"),
        ("ipv6:%5B::1%5D:40000", "::1"),
        ("ipv6:[::ffff:127.0.0.1]:40000", "127.0.0.1"),
        ("ipv6:%5B::ffff:10.0.0.7%5D:1", "10.0.0.7"),
    ],
)
def test_the_address_of_a_peer_has_no_port(peer: str, address: str) -> None:
    assert peer_address(peer) == address


def test_the_client_of_a_peer() -> None:
    assert client_of("ipv4:10.1.2.3:1000", token=False) == "tcp:10.1.2.3"
    assert client_of("ipv4:10.1.2.3:2000", token=False) == "tcp:10.1.2.3"
    assert client_of("ipv4:10.1.2.3:2000", token=True) == "token"
    assert client_of("unix:/run/embcache.sock", token=False) == "unix"
    assert client_of("unix:", token=True) == "unix"


class Context:
    def __init__(self, peer: str) -> None:
        self._peer = peer

    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self) -> tuple[()]:
        return ()


def test_two_connections_of_one_client_are_one_owner() -> None:
    registry = SessionRegistry(token=False)
    first = registry.owner_for(Context("ipv4:127.0.0.1:40001"))
    second = registry.owner_for(Context("ipv4:127.0.0.1:40002"))
    assert first == second == "anon:tcp:127.0.0.1"
    assert SessionRegistry(token=True).owner_for(Context("ipv4:1.2.3.4:5")) == "anon:token"
