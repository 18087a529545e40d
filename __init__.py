"""embcache: a GPU embedding-cache daemon for disaggregated multimodal LLM serving.

The repository root is the package root: ``service/`` imports as ``embcache.service``,
``kernels/`` as ``embcache.kernels`` and ``clients/`` as ``embcache.clients``.
Nothing heavy is imported here.
"""

__version__ = "0.1.0"
