"""Registers P2pNcclConnector (names only: nothing heavy is imported until it is built)."""

import kvx

kvx_connectors = kvx.provides_connector(
    __package__, "P2pNcclConnector", "P2pConfig", aliases="P2pNcclConnectorV1"
)
