"""``python -m embcache.service.cli``: the ``embcache`` command."""

from embcache.service.cli.app import app

app()
