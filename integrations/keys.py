"""Entry keys of the engine integrations: ``<engine>/<namespace>/<identifier>``.

An engine's identifier (vLLM's ``mm_features[i].identifier``, SGLang's ``mm_hash``) names
the media, not the encoder that turned it into embeddings. Two models, two revisions of one
model, or one model in two dtypes give different embeddings for the same image, so the
namespace folds in everything that changes the bytes; deployments that share a daemon then
never read each other's entries.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from embcache.errors import InvalidArgument

# The daemon's default key limit is 1024 UTF-8 bytes; a namespace is at most 64 characters.
MAX_NAMESPACE_CHARS = 64
MAX_IDENTIFIER_BYTES = 900


def derive_namespace(parts: dict[str, Any]) -> str:
    """A short stable namespace for ``parts`` (model, revision, encoder config, dtype, ...).

    The model's last path component stays readable (operators find the entries in the
    daemon's key listings); a digest of all parts keeps different configurations apart.

    Args:
        parts: JSON-serialisable values that change the embeddings' bytes.

    Returns:
        ``<model name>-<16 hex digits>``, at most 64 characters.
    """
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    digest = hashlib.sha256(blob).hexdigest()[:16]
    model = str(parts.get("model") or "model").rstrip("/").rsplit("/", 1)[-1]
    readable = "".join(c if c.isalnum() or c in "._-" else "_" for c in model)[:40] or "model"
    return f"{readable}-{digest}"


def check_namespace(namespace: object) -> str:
    """An operator-given namespace, checked.

    Raises:
        InvalidArgument: not a string of 1-64 characters without ``/`` or NUL.
    """
    if not isinstance(namespace, str) or not namespace:
        raise InvalidArgument("namespace must be a non-empty string", namespace=namespace)
    if len(namespace) > MAX_NAMESPACE_CHARS or "/" in namespace or "\x00" in namespace:
        raise InvalidArgument(
            "namespace must be at most 64 characters without '/' or NUL", namespace=namespace
        )
    return namespace


def entry_key(engine: str, namespace: str, identifier: str) -> str:
    """The daemon key of one item.

    Raises:
        InvalidArgument: an empty identifier, one with NUL, or one too long for a key.
    """
    if not isinstance(identifier, str) or not identifier:
        raise InvalidArgument("identifier must be a non-empty string", identifier=identifier)
    if "\x00" in identifier or len(identifier.encode()) > MAX_IDENTIFIER_BYTES:
        raise InvalidArgument(
            "identifier has NUL or is longer than 900 bytes", identifier=identifier[:80]
        )
    return f"{engine}/{namespace}/{identifier}"


def salt_scope(salt: object) -> str | None:
    """The key scope of a request's ``cache_salt`` (None: no salt, the shared scope).

    Requests that carry a salt read and write only entries of their own salt, so one
    tenant cannot learn or read what another's images encode to. The scope is a digest:
    the salt itself never appears in the daemon's key listings.
    """
    if salt is None or salt == "":
        return None
    return "s-" + hashlib.sha256(str(salt).encode()).hexdigest()[:24]


def scoped(identifier: str, scope: str | None) -> str:
    """``identifier`` inside ``scope`` (unchanged for the shared scope)."""
    return identifier if scope is None else f"{scope}/{identifier}"
