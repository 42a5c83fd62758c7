"""Registers NixlConnector (pull mode, also named NixlPullConnector) and NixlPushConnector
(names only: `nixl` is imported when a connector is built)."""

import kvx
from kvx import ConnectorSpec

kvx_connectors = kvx.provides(
    ConnectorSpec.in_package(
        __package__, "NixlConnector", "NixlConfig", aliases="NixlPullConnector", needs="nixl"
    ),
    ConnectorSpec.in_package(
        __package__,
        "NixlPushConnector",
        "NixlPushConfig",
        needs="nixl",
        summary="P/D disaggregation over NIXL in push mode: D registers its blocks, P WRITEs them",
    ),
)
