"""The transports: gRPC, the session socket and HTTP over one engine (``serving.py``).

Below them, shared by all three: the status table (``status.py``), rendering of engine
results (``render.py``), the one device-get flow (``device_get.py``), the call handlers
(``handlers/``) and sessions (``session/``). ``grpc/``, ``session_socket/`` and ``http/``
never import each other (``pyproject.toml``, import-linter).
"""
