from __future__ import annotations

import pytest
from pydantic import ValidationError

from embcache.service.config import Settings
from embcache.service.sizes import format_size, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4GiB", 4 * 1024**3),
        ("256KiB", 262144),
        ("1.5MiB", 1572864),
        ("1GB", 10**9),
        ("4096", 4096),
        (" 8 kib ", 8192),
        (12, 12),
    ],
)
def test_parse_size(text: object, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "4XB", "-1", "1.3B", True, None, "1e6"])
def test_parse_size_rejects(text: object) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_format_size() -> None:
    assert format_size(512) == "512 B"
    assert format_size(3 * 1024**3) == "3.0 GiB"


def test_defaults() -> None:
    s = Settings()
    assert s.page_bytes == 256 * 1024
    assert (s.grpc_host, s.grpc_port, s.http_host, s.http_port) == (
        "127.0.0.1",
        7470,
        "127.0.0.1",
        7471,
    )
    assert s.shm_prefix == "embcache-7470"  # the segment: embcache-7470-<random>
    assert s.num_host_pages * s.page_bytes == s.host_pool_bytes


def test_env_vars(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBCACHE_HOST_POOL_BYTES", "64MiB")
    monkeypatch.setenv("EMBCACHE_PAGE_BYTES", "64KiB")
    monkeypatch.setenv("EMBCACHE_LEASE_TTL_S", "2.5")
    s = Settings()
    assert (s.host_pool_bytes, s.page_bytes, s.lease_ttl_s) == (64 * 1024**2, 65536, 2.5)
    # explicit values win over the environment
    assert Settings(page_bytes="4KiB").page_bytes == 4096


def test_frozen() -> None:
    with pytest.raises(ValidationError):
        Settings().page_bytes = 4096  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"page_bytes": "3000"}, "page_bytes"),
        ({"host_pool_bytes": "junk"}, "host_pool_bytes"),
        ({"grpc_port": 70000}, "grpc_port"),
        ({"lease_ttl_s": 0}, "lease_ttl_s"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_errors_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError) as info:
        Settings(**kwargs)
    assert field in str(info.value)


def test_pool_must_be_whole_pages() -> None:
    with pytest.raises(ValidationError, match="multiple of page_bytes"):
        Settings(host_pool_bytes=1024**2 + 4096, page_bytes="64KiB")


def test_non_loopback_needs_token() -> None:
    with pytest.raises(ValidationError, match="auth_token"):
        Settings(grpc_host="0.0.0.0")
    with pytest.raises(ValidationError, match="auth_token"):
        Settings(http_host="10.1.2.3")
    assert Settings(grpc_host="0.0.0.0", auth_token="s3cret").grpc_host == "0.0.0.0"
    assert Settings(grpc_host="::1").grpc_host == "::1"


def test_is_loopback() -> None:
    from embcache.service.config import is_loopback

    for host in ("127.0.0.1", "127.1.2.3", "localhost", "::1", "[::1]"):
        assert is_loopback(host), host
    for host in ("127.foo.example", "0.0.0.0", "10.0.0.1", "::", "example.com", "1270.0.0.1"):
        assert not is_loopback(host), host
    with pytest.raises(ValidationError, match="auth_token"):
        Settings(grpc_host="127.foo.example")


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("", None), ("2", {2}), ("0-2,5", {0, 1, 2, 5}), (" 3 , 1-2 ", {1, 2, 3}), ("4,4", {4})],
)
def test_cpu_affinity(text: str, cpus: set[int] | None) -> None:
    s = Settings(cpu_affinity=text)
    assert s.cpus() == cpus
    assert Settings(cpu_affinity=s.cpu_affinity).cpus() == cpus  # the canonical form parses


@pytest.mark.parametrize("text", ["x", "3-1", "-1", "1-", "2-a", "1;2"])
def test_cpu_affinity_rejects(text: str) -> None:
    with pytest.raises(ValidationError, match="cpu_affinity"):
        Settings(cpu_affinity=text)


def test_pin_cpus_checks_then_pins() -> None:
    """Pinning to CPUs the process may not use fails with an OSError naming them; pinning to
    allowed ones is applied (checked in a child process, which it must not outlive)."""
    import os
    import subprocess
    import sys

    from embcache.service.daemon import pin_cpus

    allowed = sorted(os.sched_getaffinity(0))
    with pytest.raises(OSError, match=str(max(allowed) + 1000)):
        pin_cpus(Settings(cpu_affinity=f"{allowed[0]},{max(allowed) + 1000}"))
    assert sorted(os.sched_getaffinity(0)) == allowed  # untouched
    code = (
        "import os; from embcache.service.config import Settings; "
        "from embcache.service.daemon import pin_cpus; "
        f"pin_cpus(Settings(cpu_affinity='{allowed[-1]}')); print(sorted(os.sched_getaffinity(0)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == f"[{allowed[-1]}]"
