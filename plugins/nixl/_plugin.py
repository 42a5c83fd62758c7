"""Registers NixlConnector (pull mode, also named NixlPullConnector) and NixlPushConnector
(names only: `nixl` is imported when a connector is built, so the connector module is safe to
import in vLLM's class lookup)."""

import kvx
from kvx import ConnectorSpec

kvx_connectors = kvx.provides(
    ConnectorSpec.in_package(
        __package__,
        "NixlConnector",
        "NixlConfig",
        aliases="NixlPullConnector",
        needs="nixl",
        imports_lazily=True,
    ),
    ConnectorSpec.in_package(
        __package__,
        "NixlPushConnector",
        "NixlPushConfig",
        needs="nixl",
        imports_lazily=True,
        summary="P/D disaggregation over NIXL in push mode: D registers its blocks, P WRITEs them",
    ),
)
