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
    """``session_lane`` is ``uds_sessions`` now and ``device_put_landing_bytes`` is
    ``device_put_prealloc_bytes``; the old names still work as arguments, env vars and
    (hidden) flags."""
    s = Settings(session_lane=False, device_put_landing_bytes="1MiB")  # type: ignore[call-arg]
    assert s.uds_sessions is False and s.device_put_prealloc_bytes == 1 << 20
    monkeypatch.setenv("EMBCACHE_SESSION_LANE", "false")
    assert Settings().uds_sessions is False
    assert Settings(uds_sessions=True).uds_sessions is True  # the new name wins
    monkeypatch.delenv("EMBCACHE_SESSION_LANE")
    seen: list[Settings] = []

    probe = typer.Typer()

    @probe.command(cls=PlainHelpCommand)
    @with_settings
    def show(settings: Settings) -> None:
        seen.append(settings)

    result = CliRunner().invoke(probe, ["--session-lane", "false", "--page-bytes", "4KiB"])
    assert result.exit_code == 0, result.output
    assert seen[0].uds_sessions is False and seen[0].page_bytes == 4096
    help_text = CliRunner().invoke(probe, ["--help"], env={"COLUMNS": "250"}).output
    assert "--uds-sessions" in help_text and "--session-lane" not in help_text  # hidden
