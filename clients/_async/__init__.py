"""One client in two flavours: ``_async`` is written by hand, ``_sync`` generated from it.

``scripts/unasync.py`` rewrites each module of ``_async`` into its blocking twin in
``_sync`` (``async`` and ``await`` removed, ``AsyncX`` names to ``X``, ``async_x`` modules to
``sync_x``), so what the two clients do differently lives in ``clients/_backends``. CI fails
when ``_sync`` is not what the script would write. Docstrings and comments are copied as
they are, so they are written for both clients.
"""
