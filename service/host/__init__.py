"""The host layer: the shared-memory page pool and every table about it (``store.HostStore``).

Nothing here knows of devices, the engine or transports; the engine holds the one lock.
"""
