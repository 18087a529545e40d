"""Memory shared with other processes on the node: the client allocations and events the
daemon opens (``cache.py``) and the socket that hands out device-pool fds (``fd_server.py``).
"""
