"""Mooncake Store backend: `mooncake://MASTER_HOST:RPC_PORT?metadata=URL` on a
`mooncake_master` and its `MooncakeDistributedStore` clients.

This process joins the store as a client: it contributes `segment_mib` of its own memory to
the store's pool (other clients' values may live in it, so the values it holds vanish when it
exits) and `buffer_mib` of transfer buffer. With `segment_mib=0` it contributes none: its
values live in the store's other clients, e.g. `mooncake_client` processes run as storage
nodes, and outlive this process (what P/D through the store needs when P may exit first).
Query parameters: `metadata` (required: the master's HTTP metadata server,
`http://host:port/metadata`, or `etcd://host:port`), `segment_mib` (default 512; 0 for
none), `buffer_mib` (64), `replicas` (1: copies of each value, on
different clients), `local_hostname` (127.0.0.1: the address this client advertises; it is
also exported as `MC_TCP_BIND_ADDRESS` unless set), `ha` (`etcd`: the URL's HOST:PORT is
then the etcd in which masters run with `-enable_ha` elect their leader, and the client
follows whichever master leads). Mooncake 0.3.13's TCP transport and RPC
listeners (and the master's HTTP metadata server) still listen on every interface (seen with
`ss`): run the engines and the master in a network namespace or behind a firewall; the
tests run them in a namespace with only loopback.

The store's `store.so` links `libibverbs.so.1` even over TCP: Debian's `libibverbs1`, or a
directory holding a `libibverbs.so.1` link to the copy the nixl wheel bundles, on
`LD_LIBRARY_PATH` when the process starts (`make system-deps` makes one:
`.venv/lib/kvx-ibverbs`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qs, urlsplit

from kvx.plugins.storage.backends.base import BackendOptions, StorageBackend, copy_into

KEY_PREFIX = "kvx/"
PARAMS = ("metadata", "segment_mib", "buffer_mib", "replicas", "local_hostname", "ha")
HA_BACKENDS = ("etcd",)


def _store_class() -> Any:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise ImportError(
            f"Mooncake Store cannot be loaded ({exc}): install "
            "`pip install mooncake-transfer-engine-non-cuda` and make `libibverbs.so.1` "
            "loadable (Debian `libibverbs1`, or LD_LIBRARY_PATH naming a directory with a "
            "libibverbs.so.1 link to the nixl wheel's copy; `make system-deps` makes "
            ".venv/lib/kvx-ibverbs)"
        ) from None
    return MooncakeDistributedStore


def _int_param(params: dict[str, str], name: str, default: int, low: int, high: int) -> int:
    text = params.get(name)
    if text is None:
        return default
    if not text.isdigit() or not low <= int(text) <= high:
        raise ValueError(f"storage_url parameter {name}={text!r}: use a whole number {low}-{high}")
    return int(text)


def _flat(part: bytes | memoryview) -> bytes | memoryview:
    """`part` as the 1-D bytes-like `upsert_parts` takes (a view of it when contiguous)."""
    if isinstance(part, bytes):
        return part
    view = memoryview(part)
    return view.cast("B") if view.c_contiguous else view.tobytes()


class MooncakeBackend(StorageBackend):
    """Values as Mooncake Store objects (`kvx/<key>`), this process one of the store's
    clients."""

    def __init__(self, url: str, options: BackendOptions) -> None:
        self.url = url
        parts = urlsplit(url)
        if not parts.hostname or parts.port is None:
            raise ValueError(
                f"storage_url {url!r}: name the master's RPC address, "
                "mooncake://HOST:PORT?metadata=http://HOST:PORT/metadata"
            )
        raw = parse_qs(parts.query, keep_blank_values=True)
        unknown = sorted(set(raw) - set(PARAMS))
        if unknown:
            raise ValueError(
                f"storage_url parameter {unknown[0]!r} is unknown; allowed: {', '.join(PARAMS)}"
            )
        params = {k: v[-1] for k, v in raw.items()}
        metadata = params.get("metadata")
        if not metadata:
            raise ValueError(
                f"storage_url {url!r} has no metadata=...: the master's metadata server, "
                "e.g. metadata=http://127.0.0.1:8080/metadata"
            )
        segment = _int_param(params, "segment_mib", 512, 0, 1 << 20) << 20
        buffer = _int_param(params, "buffer_mib", 64, 1, 1 << 16) << 20
        self.replicas = _int_param(params, "replicas", 1, 1, 16)
        local = params.get("local_hostname", "127.0.0.1")
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", local)
        ha = params.get("ha")
        if ha is not None and ha not in HA_BACKENDS:
            raise ValueError(
                f"storage_url parameter ha={ha!r}: use {' or '.join(HA_BACKENDS)} (the URL's "
                "HOST:PORT then names it), or leave it out for one master at HOST:PORT"
            )
        self.store = _store_class()()
        master = f"{parts.hostname}:{parts.port}"
        if ha is not None:  # Mooncake's client finds the leading master through etcd
            master = f"{ha}://{master}"
        self._batch_bytes = buffer // 2  # a load's values must fit the client's buffer pool
        rc = self.store.setup(local, metadata, segment, buffer, "tcp", "", master)
        if rc != 0:
            raise ConnectionError(
                f"Mooncake Store at {master} (metadata {metadata}) refused this client "
                f"(setup returned {rc}); is mooncake_master running there?"
            )
        self._config: Any = None
        if self.replicas > 1:
            from mooncake.store import ReplicateConfig

            self._config = ReplicateConfig()
            self._config.replica_num = self.replicas

    def put_many(self, items: Sequence[tuple[str, bytes | memoryview]]) -> None:
        for key, value in items:
            data = bytes(value)
            if self._config is None:
                rc = self.store.upsert(KEY_PREFIX + key, data)
            else:
                rc = self.store.upsert(KEY_PREFIX + key, data, self._config)
            if rc != 0:
                raise OSError(f"Mooncake Store refused {key!r} ({len(data)} bytes): error {rc}")

    def put_vectored(self, items: Sequence[tuple[str, Sequence[bytes | memoryview]]]) -> None:
        """Each value sent from its parts (`upsert_parts`), never joined in Python."""
        for key, given in items:
            parts = [_flat(part) for part in given]
            if self._config is None:
                rc = self.store.upsert_parts(KEY_PREFIX + key, *parts)
            else:
                rc = self.store.upsert_parts(KEY_PREFIX + key, *parts, config=self._config)
            if rc != 0:
                size = sum(memoryview(p).nbytes for p in parts)
                raise OSError(f"Mooncake Store refused {key!r} ({size} bytes): error {rc}")

    def get_many(self, keys: Sequence[str], max_bytes: int) -> list[bytes | None]:
        out: list[bytes | None] = []
        # TODO: one `get` (a round trip) per key, as saves are one `upsert` per value;
        # loads into buffers (`get_vectored`) are batched already
        for key in keys:
            data = self.store.get(KEY_PREFIX + key)
            if not data:
                out.append(None)
            else:  # no copy unless too long (a copy cost 0.7x the raw client's CPU on gets)
                out.append(data if len(data) <= max_bytes + 1 else bytes(data[: max_bytes + 1]))
        return out

    def get_vectored(
        self, keys: Sequence[str], buffers: Sequence[Sequence[memoryview]]
    ) -> list[int | None]:
        """One `batch_get_buffer` per batch of values that fits half the buffer pool: each
        value lands in the client's buffer, read in place (no bytes object), then copied once
        into its parts when it has their exact length."""
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffer lists; one per key")
        totals = [sum(memoryview(b).nbytes for b in parts) for parts in buffers]
        sizes: list[int | None] = []
        start = 0
        while start < len(keys):
            stop, batch = start + 1, totals[start]
            while stop < len(keys) and batch + totals[stop] <= self._batch_bytes:
                batch += totals[stop]
                stop += 1
            handles = self.store.batch_get_buffer([KEY_PREFIX + k for k in keys[start:stop]])
            for parts, total, handle in zip(
                buffers[start:stop], totals[start:stop], handles, strict=True
            ):
                if handle is None:
                    sizes.append(None)
                    continue
                with memoryview(handle) as raw, raw.cast("B") as view:
                    if view.nbytes == total:
                        copy_into(parts, view)
                    sizes.append(view.nbytes or None)
            del handles  # back to the pool
            start = stop
        return sizes

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        found = self.store.batch_is_exist([KEY_PREFIX + key for key in keys])
        return [n == 1 for n in found]

    def close(self) -> None:
        self.store.close()
