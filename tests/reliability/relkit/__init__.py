"""Reliability harness of embcache: daemon processes, checksummed payloads, workers,
the soak, injected faults, malformed input and figures tables.

Used by ``tests/reliability`` (CI-sized runs) and ``bench/soak.py`` (full runs). Only
loopback TCP and Unix sockets are used; every process started here is ended by its pid.
"""
