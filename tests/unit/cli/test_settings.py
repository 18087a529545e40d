"""The settings flags of ``embcache serve`` (``service/cli/settings.py``)."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from embcache.service.cli import app
from embcache.service.cli.settings import PlainHelpCommand, with_settings
from embcache.service.config import Settings


def test_serve_help_lists_every_setting_with_its_text() -> None:
    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    for name in Settings.model_fields:
        assert "--" + name.replace("_", "-") in text, name
    # square brackets in a description are text, not rich markup ('[/db]' once broke --help)
    assert "host:port[,host:port...][/db]" in text.replace("│", "").replace(" ", "")


def test_renamed_settings_keep_their_old_names_for_one_release(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The session socket's settings were ``uds_sessions`` (before that ``session_lane``),
    ``tcp_lane`` and ``tcp_lane_port``, and ``device_put_landing_bytes`` is
    ``device_put_prealloc_bytes``; the old names still work as arguments, env vars and
    (hidden) flags."""
    s = Settings(  # type: ignore[call-arg]
        session_socket=False, tcp_lane=False, tcp_lane_port=7999, device_put_landing_bytes="1MiB"
    )
    assert s.session_socket is False and s.device_put_prealloc_bytes == 1 << 20
    assert s.session_socket_tcp is False and s.session_socket_tcp_port == 7999
    assert Settings(uds_sessions=False).session_socket is False  # type: ignore[call-arg]
    monkeypatch.setenv("EMBCACHE_SESSION_LANE", "false")
    assert Settings().session_socket is False
    assert Settings(session_socket=True).session_socket is True  # the new name wins
    monkeypatch.delenv("EMBCACHE_SESSION_LANE")
    monkeypatch.setenv("EMBCACHE_TCP_LANE_PORT", "7998")
    assert Settings().session_socket_tcp_port == 7998
    monkeypatch.delenv("EMBCACHE_TCP_LANE_PORT")
    seen: list[Settings] = []

    probe = typer.Typer()

    @probe.command(cls=PlainHelpCommand)
    @with_settings
    def show(settings: Settings) -> None:
        seen.append(settings)

    argv = ["--uds-sessions", "false", "--tcp-lane", "false", "--page-bytes", "4KiB"]
    result = CliRunner().invoke(probe, argv)
    assert result.exit_code == 0, result.output
    assert seen[0].session_socket is False and seen[0].page_bytes == 4096
    assert seen[0].session_socket_tcp is False
    help_text = CliRunner().invoke(probe, ["--help"], env={"COLUMNS": "250"}).output
    assert "--session-socket " in help_text and "--session-socket-tcp-port" in help_text
    for old in ("--session-lane", "--uds-sessions", "--tcp-lane"):
        assert old not in help_text  # hidden


def _serve_help(columns: int) -> str:
    """``embcache serve --help`` as a user's terminal of ``columns`` shows it (a subprocess)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "COLUMNS": str(columns)}
    cmd = [sys.executable, "-m", "embcache.service.cli", "serve", "--help"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, check=True)
    return out.stdout


@pytest.mark.parametrize("columns", [80, 200])
def test_serve_help_shows_type_default_and_env_of_every_flag_uncut(columns: int) -> None:
    from embcache.service.cli.settings_help import env_var, format_default, metavar

    text = _serve_help(columns)
    assert "…" not in text  # nothing cut short
    assert all(len(line) <= max(columns, 100) for line in text.splitlines())
    words = " ".join(text.split())
    for name, field in Settings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        # each flag whole, followed by its type or unit
        assert f" {flag} {metavar(name, field)} " in f" {words} ", name
        # the flag's own help ends with its default and its env var
        start = words.index(f"{flag} {metavar(name, field)}")
        part = words[start : start + 2000]
        assert f"default: {format_default(name, field)}" in part, name
        assert f"env: {env_var(name)}]" in part, name


def test_help_types_and_defaults_are_the_models() -> None:
    from embcache.service.cli.settings_help import format_default, metavar, value_range

    fields = Settings.model_fields
    assert metavar("host_pool_bytes", fields["host_pool_bytes"]) == "SIZE"
    assert format_default("host_pool_bytes", fields["host_pool_bytes"]) == "1GiB"
    assert format_default("page_bytes", fields["page_bytes"]) == "256KiB"
    assert metavar("warm_restart", fields["warm_restart"]) == "on|off"
    assert format_default("warm_restart", fields["warm_restart"]) == "on"
    assert metavar("lease_ttl_s", fields["lease_ttl_s"]) == "SECONDS"
    assert metavar("ipc_mode", fields["ipc_mode"]) == "fd|legacy"
    assert metavar("grpc_socket", fields["grpc_socket"]) == "PATH"
    assert format_default("grpc_socket", fields["grpc_socket"]) == "none"
    assert value_range(fields["grpc_port"]) == ">= 0, <= 65535"
    # every value the help shows as a default is one the flag takes back
    flags = {n: format_default(n, f) for n, f in fields.items()}
    given = {n: v for n, v in flags.items() if v not in ("none", "empty")}
    assert Settings(**given) == Settings()


def test_refusals_reach_stderr_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Invoked in-process (whatever handlers the process's logging has), a settings error is
    one ``cannot start`` line per bad setting on stderr, naming flag or variable."""
    monkeypatch.setenv("EMBCACHE_PAGE_BYTES", "1000")
    result = CliRunner().invoke(app, ["serve", "--host-pool-bytes", "0"])
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 2, lines
    assert any(
        line.endswith("cannot start: --host-pool-bytes 0: must be positive") for line in lines
    )
    assert any("cannot start: EMBCACHE_PAGE_BYTES=1000 (--page-bytes): must be a power of two"
               in line for line in lines)  # fmt: skip
    assert "Value error" not in result.stderr and "pydantic" not in result.stderr
