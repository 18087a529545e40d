"""Names and sizes both ends of the wire agree on (the .proto holds the messages)."""

from __future__ import annotations

SERVICE_PATH = "/embcache.v1.EmbeddingCache/"  # prefix of every method's path
CHUNK_BYTES = 1 << 20  # payload per Put / GetBytes chunk message
MAX_MESSAGE_BYTES = CHUNK_BYTES + 128 * 1024  # a chunk and its header, on every transport

# gRPC metadata
AUTH_KEY = "authorization"  # "Bearer <token>"
SESSION_KEY = "x-embcache-session"  # the session a call's leases belong to
ERROR_TYPE_KEY = "embcache-error"  # trailing metadata: the error's type name

# The session socket: Session calls over a plain Unix socket beside the gRPC one.
SESSION_SOCKET_SUFFIX = ".lane"  # it listens at the gRPC socket's path plus this
# Its `transport` in metrics labels and session listings (fixed names: docs/grpc.md).
SESSION_SOCKET_LABEL = "lane"

SLOT_ALIGN = 16  # GetInto packs entries at offsets that are multiples of this
# A host get's entries sent as copies after its result, at most this many bytes per reply
# (the rest are views); a same-node client copying from the read table keeps to it too.
INLINE_TOTAL = 1 << 20

# REST headers of the bytes routes
DTYPE_HEADER = "X-Embcache-Dtype"
SHAPE_HEADER = "X-Embcache-Shape"
CHECKSUM_HEADER = "X-Embcache-Checksum"
NBYTES_HEADER = "X-Embcache-Nbytes"
