"""Plugins that make embcache part of serving engines' encode/prefill/decode deployments.

``embcache.integrations.vllm`` (an EC connector) and ``embcache.integrations.sglang`` (an
embedding-store backend). Importing this package imports neither engine: each subpackage
imports its engine only where a class must subclass the engine's own (docs/integrations.md).
"""
