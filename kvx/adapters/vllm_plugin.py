"""vLLM general plugin (entry point group `vllm.general_plugins`): registers every kvx connector
in vLLM's connector factory as `kvx.<name>`, so a config needs no module path:

    {"kv_connector": "kvx.SharedStorageConnector", "kv_role": "kv_both",
     "kv_connector_extra_config": {"storage_url": "file:///tmp/kv"}}

The `kvx.` prefix keeps kvx's names apart from vLLM's own (`ExampleConnector`, `MultiConnector`,
`NixlConnector`, ... exist in both). Registration is lazy on vLLM's side: nothing of the adapter
is imported until an engine uses one of the names.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

PREFIX = "kvx."


def register() -> None:
    """Called by vLLM in each of its processes; a failure is logged, never raised into vLLM."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        from kvx.adapters.vllm_config import known_connectors
        from kvx.registry import get_registry

        for name in known_connectors(get_registry()):
            try:
                KVConnectorFactory.register_connector(PREFIX + name, "kvx.adapters.vllm", name)
            except ValueError:  # already registered in this process
                continue
    except Exception:
        logger.exception("kvx could not register its connectors with vLLM")
