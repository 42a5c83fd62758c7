"""The suite `pytest -p kvx.conformance --kvx-config '<json>'` collects: the whole kit, with the
connector config from the command line (the plugin's default `kvx_config` fixture)."""

from kvx.conformance.kit import AllScenarios


class TestKvxConformance(AllScenarios):
    """Every scenario against `--kvx-config`."""
