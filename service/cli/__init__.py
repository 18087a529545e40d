"""The ``embcache`` command: ``serve`` and the operator commands."""

from embcache.service.cli.app import app

__all__ = ["app"]
