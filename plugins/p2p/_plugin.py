"""Registers P2pNcclConnector (names only: nothing heavy is imported until it is built)."""

import kvx

kvx_connectors = kvx.provides(
    kvx.ConnectorSpec(
        name="P2pNcclConnector",
        aliases=("P2pNcclConnectorV1",),
        target="kvx.plugins.p2p.connector:P2pNcclConnector",
        summary="prefill/decode hand-off: P pushes (PUT, PUT_ASYNC) or D pulls (GET) KV "
        "between workers; ZMQ control, NCCL data on CUDA, ZMQ frames on CPU",
        config_schema="kvx.plugins.p2p.config:P2pConfig",
    )
)
