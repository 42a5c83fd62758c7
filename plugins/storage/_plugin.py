"""Registers SharedStorageConnector and its storage backends (names only; nothing heavy is
imported until a connector or backend is built)."""

import kvx

kvx_connectors = kvx.provides_connector(
    __package__, "SharedStorageConnector", "SharedStorageConfig", aliases="ExampleConnector"
)

kvx_storage_backends = kvx.provides(
    kvx.StorageBackendSpec(
        name="file",
        target="kvx.plugins.storage.backends.local_files:LocalFileBackend",
        schemes=("file", "local"),
        summary="local files (a private directory); whole blocks in native code, checksummed",
    ),
    kvx.StorageBackendSpec(
        name="fsspec",
        target="kvx.plugins.storage.backends.fsspec_backend:FsspecBackend",
        schemes=("memory",),
        other_schemes="kvx.plugins.storage.backends.schemes:fsspec_knows",
        summary="fsspec filesystems: memory, object stores (s3://, gs://...), others",
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

kvx_cli_commands = kvx.provides(
    kvx.CommandSpec(
        "store",
        "kvx.plugins.storage.store_cli:run",
        summary="list, inspect and evict stored KV (kvx store ls|info|evict URL)",
    )
)
