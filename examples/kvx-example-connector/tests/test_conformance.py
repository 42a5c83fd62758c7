"""The whole kvx conformance suite on this connector, once per `kvx_config` in conftest.py."""

from kvx.conformance.kit import AllScenarios


class TestExampleConnector(AllScenarios):
    pass
