"""embcache as SGLang's multimodal embedding store (``store.EmbCacheEmbeddingStore``).

Importing this package does not import SGLang; ``EmbCacheEmbeddingStore`` is loaded on
first access, and ``register()`` is the ``sglang.srt.plugins`` entry point that makes the
backend known to ``EmbeddingStoreFactory`` as ``embcache``.
"""

from __future__ import annotations

from typing import Any

BACKEND_NAME = "embcache"
BACKEND_MODULE = "embcache.integrations.sglang.store"


def register() -> None:
    """Register the ``embcache`` backend with SGLang's ``EmbeddingStoreFactory``.

    SGLang loads general plugins once per process; a second registration of the same
    class is skipped rather than overwritten (the factory would log a warning).
    """
    from sglang.srt.mem_cache.embedding_store import EmbeddingStoreFactory

    # The factory offers no public lookup of what is registered.
    entry = EmbeddingStoreFactory._registry.get(BACKEND_NAME)  # noqa: SLF001
    if entry is not None and entry.get("module_path") == BACKEND_MODULE:
        return
    EmbeddingStoreFactory.register_backend(BACKEND_NAME, BACKEND_MODULE, "EmbCacheEmbeddingStore")


def __getattr__(name: str) -> Any:
    if name == "EmbCacheEmbeddingStore":
        from embcache.integrations.sglang.store import EmbCacheEmbeddingStore

        return EmbCacheEmbeddingStore
    raise AttributeError(name)
