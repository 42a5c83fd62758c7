"""Registers LMCacheConnectorV1 (names only: `lmcache` is imported when the connector is built)."""

import kvx

kvx_connectors = kvx.provides(
    kvx.ConnectorSpec(
        name="LMCacheConnectorV1",
        aliases=("LMCacheConnector",),
        target="kvx.plugins.lmcache.connector:LMCacheConnectorV1",
        summary="stores and loads KV chunks through LMCache (CPU, disk, redis://, lm://)",
        config_schema="kvx.plugins.lmcache.config:LMCacheConfig",
        requires=("lmcache",),
        extra="lmcache",
    )
)
