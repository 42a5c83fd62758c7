"""Registers MultiConnector (names only; nothing is imported until it is used)."""

import kvx

kvx_connectors = kvx.provides(
    kvx.ConnectorSpec.in_package(
        __package__,
        "MultiConnector",
        config="MultiConnectorConfig",
        summary="composes connectors: load from the first with a hit, save to all",
        child_configs_key="connectors",
    )
)
