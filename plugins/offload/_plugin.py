"""Registers OffloadingConnector (names only; nothing is imported until it is used)."""

import kvx

kvx_connectors = kvx.provides(
    kvx.ConnectorSpec(
        name="OffloadingConnector",
        target="kvx.plugins.offload:OffloadingConnector",
        summary="offloads KV chunks to a CPU tier (LRU or ARC) and loads them back async",
        config_schema="kvx.plugins.offload.config:OffloadingConfig",
    )
)
