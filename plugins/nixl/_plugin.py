"""Registers NixlConnector (names only: `nixl` is imported when the connector is built)."""

import kvx

kvx_connectors = kvx.provides_connector(
    __package__, "NixlConnector", "NixlConfig", aliases="NixlPullConnector", needs="nixl"
)
