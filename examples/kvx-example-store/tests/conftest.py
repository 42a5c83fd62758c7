"""What the kvx conformance kit needs from this package's tests: the config under test."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture
def kvx_config() -> dict[str, Any]:
    """The store in a fresh directory per scenario (`{tmp}`), shared by its engines."""
    return {
        "kv_connector": "ExampleStoreConnector",
        "kv_connector_extra_config": {"directory": "{tmp}"},
    }
