"""Registers P2pNcclConnector (names only: nothing heavy is imported until it is built)."""

import kvx

kvx_connectors = kvx.provides(
    kvx.ConnectorSpec.in_package(
        __package__,
        "P2pNcclConnector",
        config="P2pConfig",
        aliases=("P2pNcclConnectorV1",),
        summary="prefill/decode hand-off: P pushes (PUT, PUT_ASYNC) or D pulls (GET) KV "
        "between workers; ZMQ control, NCCL data on CUDA, ZMQ frames on CPU",
    )
)
