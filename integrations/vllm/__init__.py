"""embcache as vLLM's encoder-cache connector (``connector.EmbCacheECConnector``).

Importing this package does not import vLLM; ``register()`` is the ``vllm.general_plugins``
entry point that makes the connector known to vLLM by name.
"""

from __future__ import annotations

CONNECTOR_NAME = "EmbCacheECConnector"
CONNECTOR_MODULE = "embcache.integrations.vllm.connector"


def register() -> None:
    """Register ``EmbCacheECConnector`` with vLLM's ``ECConnectorFactory``.

    vLLM runs general plugins in every process it starts, so this runs many times in one
    process too: a name already registered (by this or an earlier call) is left as it is.
    """
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    # The factory raises on a second registration and offers no public lookup.
    if CONNECTOR_NAME in ECConnectorFactory._registry:  # noqa: SLF001
        return
    ECConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
