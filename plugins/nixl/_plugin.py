"""Registers NixlConnector (names only: `nixl` is imported when the connector is built)."""

import kvx

kvx_connectors = kvx.provides(
    kvx.ConnectorSpec(
        name="NixlConnector",
        aliases=("NixlPullConnector",),
        target="kvx.plugins.nixl.connector:NixlConnector",
        summary="prefill/decode hand-off: D reads P's KV blocks with NIXL (UCX) READs",
        config_schema="kvx.plugins.nixl.config:NixlConfig",
        requires=("nixl",),
        extra="nixl",
    )
)
