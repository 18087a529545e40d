"""Value forms the settings accept: byte sizes with units, segment names, HTTP Hosts and
origins, and loopback addresses.

Kept apart from the field groups because more than one group (and the HTTP plane's Host
check) reads them.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated

from pydantic import BeforeValidator

from embcache.service.sizes import parse_size

ByteSize = Annotated[int, BeforeValidator(parse_size)]

_LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}
SHM_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")  # a file name under /dev/shm
# An HTTP Host (a DNS name, an IPv4 address or a bracketed IPv6 one, and an optional port),
# and an origin (http or https, then such a Host).
HOST_PORT = re.compile(r"(?:[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,252})|\[[0-9A-Fa-f:.]+\])(?::\d{1,5})?")
ORIGIN = re.compile(r"https?://" + HOST_PORT.pattern)


def is_loopback(host: str) -> bool:
    """True for loopback addresses (127.0.0.0/8, ::1) and ``localhost``; not for names that
    merely start with "127." (``127.foo.example`` resolves wherever DNS says)."""
    if host in _LOOPBACK_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
