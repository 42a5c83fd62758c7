"""Registers OffloadingConnector (names only; nothing is imported until it is used)."""

import kvx

kvx_connectors = kvx.provides_connector(__package__, "OffloadingConnector", "OffloadingConfig")
