"""A plugin that tries to take a name the main test plugin already owns (must be refused)."""

import kvx
from kvx import ConnectorSpec


@kvx.hookimpl
def kvx_connectors() -> list[ConnectorSpec]:
    return [ConnectorSpec(name="EchoConnector", target="kvx_test_plugin.connectors:EchoConnector")]
