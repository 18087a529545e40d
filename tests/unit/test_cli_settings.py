"""The settings flags of ``embcache serve`` (``service/cli_settings.py``)."""

from __future__ import annotations

from typer.testing import CliRunner

from embcache.service.cli import app
from embcache.service.config import Settings


def test_serve_help_lists_every_setting_with_its_text() -> None:
    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    for name in Settings.model_fields:
        assert "--" + name.replace("_", "-") in text, name
    # square brackets in a description are text, not rich markup ('[/db]' once broke --help)
    assert "host:port[,host:port...][/db]" in text.replace("│", "").replace(" ", "")
