"""Registers OffloadingConnector (names only; nothing is imported until it is used)."""

import kvx

kvx_connectors = kvx.provides(
    kvx.ConnectorSpec.in_package(
        __package__,
        "OffloadingConnector",
        config="OffloadingConfig",
        summary="offloads KV chunks to a CPU tier (LRU or ARC) and loads them back async",
    )
)
