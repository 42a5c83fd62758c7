"""Registers the connector with kvx: names only, nothing heavy is imported here."""

import kvx

kvx_connectors = kvx.provides_connector(
    __package__, "ExampleStoreConnector", "ExampleStoreConfig", aliases="ExampleStoreConnectorV1"
)
