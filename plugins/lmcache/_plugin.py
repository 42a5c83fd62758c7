"""Registers LMCacheConnectorV1 (names only: `lmcache` is imported when the connector is built)."""

import kvx

kvx_connectors = kvx.provides(
    kvx.ConnectorSpec.in_package(
        __package__,
        "LMCacheConnectorV1",
        config="LMCacheConfig",
        aliases=("LMCacheConnector",),
        summary="stores and loads KV chunks through LMCache (CPU, disk, redis://, lm://)",
        requires=("lmcache",),
        extra="lmcache",
    )
)
