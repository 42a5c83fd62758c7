"""Registers MultiConnector (names only; nothing is imported until it is used)."""

import kvx

kvx_connectors = kvx.provides_connector(
    __package__, "MultiConnector", "MultiConnectorConfig", child_configs_key="connectors"
)
