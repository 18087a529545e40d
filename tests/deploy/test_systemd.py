"""The systemd unit: its ExecStart parses with the daemon's own CLI into valid Settings,
its environment file holds real settings, and the hardening keeps what the daemon needs
(pinned memory, /dev/shm, the GPU devices, a runtime directory for the socket).
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import typer

from embcache.service.cli import app
from embcache.service.config import Settings

Unit = dict[str, dict[str, list[str]]]


def parse_unit(text: str) -> Unit:
    """section -> key -> values (systemd keys may repeat); continuations joined."""
    unit: Unit = {}
    section: dict[str, list[str]] | None = None
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith(("#", ";"))):
            continue
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        line, pending = pending + line, ""
        if line.startswith("[") and line.endswith("]"):
            section = unit.setdefault(line[1:-1], {})
            continue
        assert section is not None, f"{line!r} outside a section"
        key, sep, value = line.partition("=")
        assert sep, f"not a key=value line: {line!r}"
        section.setdefault(key.strip(), []).append(value.strip())
    return unit


def parse_env_file(text: str) -> dict[str, str]:
    env = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep, f"not KEY=value: {line!r}"
        env[key.strip()] = value.strip().strip('"')
    return env


def seconds(value: str) -> float:
    units = {"ms": 0.001, "s": 1, "min": 60, "m": 60, "h": 3600}
    for suffix, scale in units.items():
        if value.endswith(suffix) and value[: -len(suffix)].replace(".", "").isdigit():
            return float(value[: -len(suffix)]) * scale
    return float(value)


def serve_params(argv: list[str]) -> dict[str, Any]:
    """Parse ``serve ...`` with the real typer app, without running the daemon."""
    group = typer.main.get_command(app)  # click's classes (typer may vendor its own click)
    root = group.context_class(group, info_name="embcache")
    name, *rest = argv
    command = group.get_command(root, name)  # type: ignore[attr-defined]
    assert command is not None, f"no command {name!r}"
    ctx = command.make_context(name, rest, parent=root)
    return dict(ctx.params)


@pytest.fixture(scope="module")
def unit(repo: Path) -> Unit:
    return parse_unit((repo / "deploy" / "systemd" / "embcache.service").read_text())


@pytest.fixture(scope="module")
def service(unit: Unit) -> dict[str, str]:
    """[Service] with the last value of each key (what systemd uses for single values)."""
    return {key: values[-1] for key, values in unit["Service"].items()}


@pytest.fixture
def unit_settings(
    repo: Path, service: dict[str, str], settings_from_env: Callable[[dict[str, str]], Settings]
) -> Settings:
    """Settings as the unit starts them: the env file's variables, then ExecStart's flags."""
    env = parse_env_file((repo / "deploy" / "systemd" / "embcache.env").read_text())
    settings_from_env(env)  # the file alone is valid (names checked too)
    argv = shlex.split(service["ExecStart"])
    assert Path(argv[0]).name == "embcache"
    params = serve_params(argv[1:])
    given = {name: value for name, value in params.items() if value is not None}
    assert given, "ExecStart passes settings flags"
    assert set(given) <= set(Settings.model_fields)
    flags = {f"EMBCACHE_{name.upper()}": str(value) for name, value in given.items()}
    return settings_from_env({**env, **flags})  # flags win, as in the CLI


def test_unit_parser() -> None:
    parsed = parse_unit("[Unit]\nA=1\n# c\n[Service]\nB=x \\\n  y\nB=z\n")
    assert parsed == {"Unit": {"A": ["1"]}, "Service": {"B": ["x y", "z"]}}


def test_cli_parsing_is_strict() -> None:
    # The parse below is meaningful only if unknown flags and bad commands are refused.
    with pytest.raises(Exception, match="no-such-flag") as refused:
        serve_params(["serve", "--no-such-flag", "1"])
    assert type(refused.value).__name__ == "NoSuchOption"
    with pytest.raises(AssertionError):
        serve_params(["no-such-command"])
    assert serve_params(["serve", "--grpc-port", "7"])["grpc_port"] == "7"


def test_exec_start_parses_with_the_cli(unit_settings: Settings) -> None:
    assert unit_settings.grpc_socket == Path("/run/embcache/embcache.sock")


def test_runtime_directory_holds_the_socket(
    service: dict[str, str], unit_settings: Settings
) -> None:
    assert unit_settings.grpc_socket is not None
    assert unit_settings.grpc_socket.parent == Path("/run") / service["RuntimeDirectory"]


def test_stop_timeout_exceeds_the_drain(service: dict[str, str], unit_settings: Settings):
    assert service.get("KillSignal", "SIGTERM") == "SIGTERM"  # SIGTERM drains
    assert seconds(service["TimeoutStopSec"]) >= unit_settings.drain_grace_s + 10


def test_runs_as_a_dedicated_user(repo: Path, service: dict[str, str]) -> None:
    if service.get("DynamicUser") == "yes":
        return
    assert service["User"] not in ("root", "0")
    sysusers = (repo / "deploy" / "systemd" / "embcache.sysusers").read_text()
    declared = [ln.split()[1] for ln in sysusers.splitlines() if ln.startswith("u ")]
    assert service["User"] in declared, "the user is created by the sysusers.d file"


def test_hardening(service: dict[str, str]) -> None:
    expected = {
        "ProtectSystem": "strict",
        "PrivateTmp": "yes",
        "NoNewPrivileges": "yes",
        "ProtectHome": "yes",
        "ProtectKernelTunables": "yes",
        "ProtectKernelModules": "yes",
        "ProtectControlGroups": "yes",
        "RestrictSUIDSGID": "yes",
        "LockPersonality": "yes",
        "LimitMEMLOCK": "infinity",  # the pool is pinned
    }
    for key, value in expected.items():
        assert service.get(key) == value, key
    assert service.get("CapabilityBoundingSet") == "", "no capabilities at all"
    assert service.get("SystemCallFilter", "").startswith("@system-service")


def test_keeps_dev_shm_and_the_gpus_reachable(service: dict[str, str]) -> None:
    # PrivateDevices hides /dev/nvidia* and gives a private /dev/shm that clients cannot
    # see; PrivateIPC would split legacy CUDA IPC from clients.
    assert service.get("PrivateDevices", "no") == "no"
    assert service.get("PrivateIPC", "no") == "no"
    assert service.get("DevicePolicy", "auto") == "auto"
    for key in ("InaccessiblePaths", "TemporaryFileSystem"):
        assert "/dev" not in service.get(key, ""), key
    # Under ProtectSystem=strict /dev stays writable, so the segment can be created.
    assert service.get("MemoryDenyWriteExecute", "no") == "no"


def test_install_section(unit: Unit) -> None:
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]
    assert "network-online.target" in unit["Unit"]["After"][0]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_systemd_accepts_every_directive(repo: Path, tmp_path: Path) -> None:
    """``systemd-analyze verify`` warns on unknown keys and unparsable values."""
    binary = tmp_path / "embcache"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    text = (repo / "deploy" / "systemd" / "embcache.service").read_text()
    unit_path = tmp_path / "embcache.service"
    unit_path.write_text(text.replace("/opt/embcache/bin/embcache", str(binary)))
    done = subprocess.run(
        ["systemd-analyze", "verify", str(unit_path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr
