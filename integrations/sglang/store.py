"""``EmbCacheEmbeddingStore``: embcache as SGLang's multimodal embedding store backend.

SGLang's encoder servers keep embeddings in host pools of pages (``EmbeddingCacheController``)
and move them to and from the store by raw address: a pointer and a byte count per item,
or one pair per page run. This backend maps those addresses back to views of the pools
given to ``register_buffer`` (``buffers.py``), stores each item as one flat byte entry and
copies entries back run by run. Entries are raw bytes because SGLang's calls carry no dtype
or shape; the namespace in the key (model, revision, dtype) keeps models apart.

SGLang 0.5.23 builds the backend with no arguments, so it is configured by environment
variables (docs/integrations.md): ``EMBCACHE_SGLANG_TARGET`` (required),
``EMBCACHE_SGLANG_NAMESPACE``, ``EMBCACHE_SGLANG_TOKEN`` (else ``EMBCACHE_TOKEN``) and
``EMBCACHE_SGLANG_TIMEOUT_S``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.embedding_store import EmbeddingStore

from embcache.clients import EmbCacheClient
from embcache.errors import EmbCacheError, InvalidArgument
from embcache.integrations.keys import check_namespace, derive_namespace, entry_key
from embcache.integrations.sglang.buffers import RegisteredBuffers

ENGINE = "sglang"
log = logging.getLogger("embcache.integrations.sglang")


class EmbCacheEmbeddingStore(EmbeddingStore):
    """SGLang ``EmbeddingStore`` over an embcache daemon (module docstring)."""

    def __init__(
        self,
        storage_config: Any = None,
        *,
        target: str | None = None,
        namespace: str | None = None,
        token: str | None = None,
        timeout_s: float | None = None,
    ) -> None:
        """Connect to the daemon; arguments win over the environment.

        Args:
            storage_config: ignored (SGLang passes its storage config to every backend).
            target: ``unix:/path`` or ``host:port``.
            namespace: key namespace; derived from SGLang's server arguments if absent.
            token: the daemon's bearer token.
            timeout_s: per-call deadline.

        Raises:
            InvalidArgument: no target, a bad namespace or timeout, or no namespace to be
                had (no server arguments published and none given).
        """
        env = os.environ
        target = target or env.get("EMBCACHE_SGLANG_TARGET")
        if not target:
            raise InvalidArgument(
                "EmbCacheEmbeddingStore needs EMBCACHE_SGLANG_TARGET (or target=)"
            )
        raw_timeout = (
            timeout_s if timeout_s is not None else env.get("EMBCACHE_SGLANG_TIMEOUT_S", "30")
        )
        try:
            timeout = float(raw_timeout)
        except ValueError:
            raise InvalidArgument(
                "EMBCACHE_SGLANG_TIMEOUT_S must be a number", value=raw_timeout
            ) from None
        if timeout <= 0:
            raise InvalidArgument("the timeout must be positive", value=timeout)
        namespace = namespace or env.get("EMBCACHE_SGLANG_NAMESPACE") or _namespace_from_server()
        self.namespace = check_namespace(namespace)
        self._buffers = RegisteredBuffers()
        self._client = EmbCacheClient(
            target,
            token=token or env.get("EMBCACHE_SGLANG_TOKEN") or env.get("EMBCACHE_TOKEN"),
            timeout=timeout,
            client_name="sglang-embedding-store",
        )

    def get_key(self, mm_hash: str) -> str:
        """The daemon key of an item: ``sglang/<namespace>/<mm_hash>``."""
        return entry_key(ENGINE, self.namespace, mm_hash)

    def register_buffer(self, tensor: torch.Tensor) -> None:
        """Accept a host pool's memory for the batch calls.

        Raises:
            InvalidArgument: not a contiguous CPU tensor, or overlapping a registered one.
        """
        self._buffers.register(tensor)

    # -- the five calls --------------------------------------------------------------
    def batch_is_exist(self, hashes: list[str]) -> list[bool]:
        """Whether each item is stored (one call; False for all if the daemon is away)."""
        keys = [self.get_key(h) for h in hashes]
        if not keys:
            return []
        try:
            return list(self._client.exists(keys))
        except (EmbCacheError, OSError) as exc:
            log.warning("embcache exists failed: %s", exc)
            return [False] * len(keys)

    def batch_get(self, hashes: list[str], ptrs: list[int], sizes: list[int]) -> list[bool]:
        """Copy each item into one buffer; True where the whole entry was copied.

        Raises:
            InvalidArgument: lists of different lengths or unregistered memory (before
                anything is fetched).
        """
        _same_length(hashes, ptrs, sizes)
        return self.batch_get_into_multi_buffers(hashes, [[p] for p in ptrs], [[n] for n in sizes])

    def batch_put(self, hashes: list[str], ptrs: list[int], sizes: list[int]) -> list[bool]:
        """Store each item from one buffer; True where it is stored (new or already there).

        Raises:
            InvalidArgument: lists of different lengths or unregistered memory (before
                anything is stored).
        """
        _same_length(hashes, ptrs, sizes)
        return self.batch_put_from_multi_buffers(hashes, [[p] for p in ptrs], [[n] for n in sizes])

    def batch_get_into_multi_buffers(
        self, hashes: list[str], ptrs: list[list[int]], sizes: list[list[int]]
    ) -> list[bool]:
        """Copy each item's bytes over its page runs, in order.

        An entry whose size is not the runs' total is a miss (False), as is a missing one.

        Raises:
            InvalidArgument: lists of different lengths or unregistered memory.
        """
        _same_length(hashes, ptrs, sizes)
        runs = [self._buffers.views(p, n) for p, n in zip(ptrs, sizes, strict=True)]
        keys = [self.get_key(h) for h in hashes]
        if not keys:
            return []
        try:
            leased = self._client.get(keys)
        except (EmbCacheError, OSError) as exc:
            log.warning("embcache get of %d item(s) failed: %s", len(keys), exc)
            return [False] * len(keys)
        results = []
        with leased as tensors:
            for key, tensor, dst in zip(keys, tensors, runs, strict=True):
                results.append(tensor is not None and _copy_out(key, tensor, dst))
        return results

    def batch_put_from_multi_buffers(
        self, hashes: list[str], ptrs: list[list[int]], sizes: list[list[int]]
    ) -> list[bool]:
        """Store each item from its page runs (joined in order) as one entry.

        Raises:
            InvalidArgument: lists of different lengths or unregistered memory (checked for
                every item before the first is stored).
        """
        _same_length(hashes, ptrs, sizes)
        runs = [self._buffers.views(p, n) for p, n in zip(ptrs, sizes, strict=True)]
        keys = [self.get_key(h) for h in hashes]
        results = []
        for key, parts in zip(keys, runs, strict=True):
            payload = parts[0] if len(parts) == 1 else torch.cat(parts) if parts else None
            if payload is None or payload.numel() == 0:
                log.warning("embcache put of %s: no bytes given", key)
                results.append(False)
                continue
            try:
                self._client.put(key, payload)
                results.append(True)  # created, or the same entry was already there
            except (EmbCacheError, OSError) as exc:
                log.warning("embcache put of %s failed: %s", key, exc)
                results.append(False)
        return results

    def close(self) -> None:
        """Close the client (its session's leases end with it)."""
        self._client.close()


def _copy_out(key: str, entry: torch.Tensor, runs: Sequence[torch.Tensor]) -> bool:
    src = entry.reshape(-1).view(torch.uint8)
    total = sum(r.numel() for r in runs)
    if src.numel() != total:
        log.warning("embcache entry %s has %d bytes, the runs %d: a miss", key, src.numel(), total)
        return False
    pos = 0
    for run in runs:
        run.copy_(src[pos : pos + run.numel()])
        pos += run.numel()
    return True


def _same_length(*lists: Sequence[Any]) -> None:
    if len({len(x) for x in lists}) > 1:
        raise InvalidArgument(
            "hashes, ptrs and sizes differ in length", lengths=[len(x) for x in lists]
        )


def _namespace_from_server() -> str:
    """The namespace of the model SGLang serves (its published server arguments)."""
    try:
        from sglang.srt.runtime_context import get_server_args

        args = get_server_args()
    except Exception as exc:  # not published in this process
        raise InvalidArgument(
            "no SGLang server arguments in this process: set EMBCACHE_SGLANG_NAMESPACE",
            reason=str(exc),
        ) from None
    return derive_namespace(
        {
            "model": getattr(args, "model_path", None),
            "revision": getattr(args, "revision", None),
            "dtype": str(getattr(args, "dtype", None)),
        }
    )
