"""Registers LMCacheConnectorV1 (names only: `lmcache` is imported when the connector is built)."""

import kvx

kvx_connectors = kvx.provides_connector(
    __package__, "LMCacheConnectorV1", "LMCacheConfig", aliases="LMCacheConnector", needs="lmcache"
)
