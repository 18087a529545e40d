"""The embcache daemon: host store, device tier, engine, shared tier, transports, CLI.

The layers and who may import whom are in ``pyproject.toml`` (``lint-imports``).
"""
