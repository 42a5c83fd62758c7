"""Registers SharedStorageConnector and its storage backends (names only; nothing heavy is
imported until a connector or backend is built)."""

import kvx

kvx_connectors = kvx.provides_connector(
    __package__, "SharedStorageConnector", "SharedStorageConfig", aliases="ExampleConnector"
)

kvx_storage_backends = kvx.provides(
    kvx.StorageBackendSpec(
        name="fsspec",
        target="kvx.plugins.storage.backends.fsspec_backend:FsspecBackend",
        schemes=("file", "local", "memory"),
        other_schemes="kvx.plugins.storage.backends.schemes:fsspec_knows",
        summary="files through fsspec: local disk, memory, object stores",
    ),
    kvx.StorageBackendSpec(
        name="redis",
        target="kvx.plugins.storage.backends.redis_backend:RedisBackend",
        schemes=("redis", "rediss", "valkey", "valkeys"),
        summary=(
            "Redis or Valkey, one server or a cluster: one value per block, PP stage and "
            "head shard under kvx/<key>; pipelined; optional TTL"
        ),
        requires=("redis",),
        extra="redis",
    ),
    kvx.StorageBackendSpec(
        name="mooncake",
        target="kvx.plugins.storage.backends.mooncake_backend:MooncakeBackend",
        schemes=("mooncake",),
        summary="Mooncake Store (mooncake_master + store clients over TCP)",
        requires=("mooncake",),
    ),
)
