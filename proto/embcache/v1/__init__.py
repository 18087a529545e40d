"""embcache.v1 wire contract; the generated modules live beside this file.

Importing this package makes sure they exist and match the .proto (see ``embcache.proto``).
"""

from embcache import proto as _proto

_proto.ensure_stubs()
