"""MultiConnector's extra config: besides `connectors` (whole child configs, validated by kvx
recursively) it takes no keys."""

import msgspec


class MultiConnectorConfig(msgspec.Struct, forbid_unknown_fields=True):
    """No options besides the `connectors` list."""
