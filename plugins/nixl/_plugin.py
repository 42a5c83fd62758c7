"""Registers NixlConnector (names only: `nixl` is imported when the connector is built)."""

import kvx

kvx_connectors = kvx.provides(
    kvx.ConnectorSpec.in_package(
        __package__,
        "NixlConnector",
        config="NixlConfig",
        aliases=("NixlPullConnector",),
        summary="prefill/decode hand-off: D reads P's KV blocks with NIXL (UCX) READs",
        requires=("nixl",),
        extra="nixl",
    )
)
