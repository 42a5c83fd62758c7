"""The Mooncake backend against Mooncake's own client, beside the Redis Cluster and file backends.

The same bytes (`--values` values per batch, each `--chunks` scattered 32 KiB chunks of a
uint8 "KV cache" behind a 64-byte header, as the connector saves blocks) are saved and loaded
by:

- `kvx mooncake`: `mooncake://` on a `mooncake_master` with one storage node
  (`mooncake_client`), this process holding no memory (`segment_mib=0`);
- `mooncake raw`: `MooncakeDistributedStore` itself, the same store and client: `upsert` of
  the chunks joined, `get` then a copy into the chunks;
- `kvx redis cluster`: the Redis backend on a 3+3 Redis Cluster;
- `kvx file`: the file backend on a temporary directory.

Every variant runs in each round, interleaved; figures are medians over `--rounds` of the
wall time and the CPU time of this process (`time.process_time`: Mooncake's client threads
count, the servers' CPU does not), with the ratio raw / kvx per round for Mooncake (>= 0.9 is
the target). Loaded bytes are compared with the saved ones after every load. Every server is
this script's own child on loopback; Mooncake needs `libibverbs.so.1` loadable when the
process starts:

    LD_LIBRARY_PATH=.venv/lib/kvx-ibverbs python benchmarks/bench_mooncake.py
    LD_LIBRARY_PATH=.venv/lib/kvx-ibverbs python benchmarks/bench_mooncake.py --quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))  # the tests' real-server fixtures
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_redis_cluster import CHUNK, HEADER, Cache  # noqa: E402
from kvx_test_clusters import ClusterProcesses, MooncakeMaster  # noqa: E402

import kvx  # noqa: E402
from kvx import StorageBackend  # noqa: E402
from kvx.plugins.storage.backends.base import BackendOptions, copy_into  # noqa: E402
from kvx.plugins.storage.backends.mooncake_backend import (  # noqa: E402
    KEY_PREFIX,
    MooncakeBackend,
)

Step = Callable[[list[str]], None]


def kvx_steps(backend: StorageBackend, cache: Cache, into: object) -> tuple[Step, Step]:
    def put(keys: list[str]) -> None:
        backend.put_vectored([(k, cache.buffers(i)) for i, k in enumerate(keys)])

    def get(keys: list[str]) -> None:
        sizes = backend.get_vectored(keys, [cache.buffers(i, into) for i in range(len(keys))])  # type: ignore[arg-type]
        assert all(s is not None for s in sizes)

    return put, get


def raw_steps(store: object, cache: Cache, into: object) -> tuple[Step, Step]:
    def put(keys: list[str]) -> None:
        for i, k in enumerate(keys):
            assert store.upsert(KEY_PREFIX + k, b"".join(cache.buffers(i))) == 0  # type: ignore[attr-defined]

    def get(keys: list[str]) -> None:
        for i, k in enumerate(keys):
            copy_into(cache.buffers(i, into), store.get(KEY_PREFIX + k))  # type: ignore[arg-type, attr-defined]

    return put, get


def timed(step: Step, keys: list[str]) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    step(keys)
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--values", type=int, default=32)
    parser.add_argument("--chunks", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.values, args.chunks = 8, 16
        args.rounds = min(args.rounds, 5)
    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    cache = Cache(args.values, args.chunks)
    into = torch.zeros_like(cache.rows)
    nbytes = args.values * (HEADER + args.chunks * CHUNK)
    # the batch, a round's worth of old values and headroom: values are kept between rounds
    holder_mib = max(64, 4 * nbytes >> 20)
    with (
        MooncakeMaster() as master,
        ClusterProcesses("redis") as cluster,
        tempfile.TemporaryDirectory() as files,
    ):
        master.add_holder(holder_mib)
        mooncake = MooncakeBackend(master.url + "&segment_mib=0&buffer_mib=256", BackendOptions())
        redis_cluster = kvx.open_storage_backend(cluster.url, BackendOptions())
        file = kvx.open_storage_backend(f"file://{files}", BackendOptions())
        variants: dict[str, tuple[Step, Step]] = {
            "kvx mooncake": kvx_steps(mooncake, cache, into),
            "mooncake raw": raw_steps(mooncake.store, cache, into),
            "kvx redis cluster": kvx_steps(redis_cluster, cache, into),
            "kvx file": kvx_steps(file, cache, into),
        }
        results: dict[tuple[str, str], list[tuple[float, float]]] = {}
        try:
            for r in range(args.rounds + 1):  # round 0 warms up
                for name, (put, get) in variants.items():
                    keys = [f"bench/{name.replace(' ', '_')}/r{r}/v{i}" for i in range(args.values)]
                    into.zero_()
                    p = timed(put, keys)
                    g = timed(get, keys)
                    for i in range(args.values):  # every byte lands where it belongs
                        assert all(
                            bytes(a) == bytes(b)
                            for a, b in zip(cache.buffers(i), cache.buffers(i, into), strict=True)
                        )
                    if name.startswith(("kvx mooncake", "mooncake")):  # free the pool
                        mooncake.store.batch_remove([KEY_PREFIX + k for k in keys], True)
                    if r:
                        results.setdefault((name, "put"), []).append(p)
                        results.setdefault((name, "get"), []).append(g)
                cluster.flush()
        finally:
            for backend in (mooncake, redis_cluster, file):
                backend.close()
    label = "quick (not a result): " if args.quick else ""
    print(
        f"{label}{args.values} values x ({args.chunks} x 32 KiB + 64 B) = "
        f"{nbytes / 2**20:.0f} MiB per batch; medians of {args.rounds} rounds (shared machine)\n"
    )
    print("| variant | op | wall ms | CPU ms | GB/s (wall) | raw/kvx CPU | raw/kvx wall |")
    print("|---|---|---|---|---|---|---|")
    for (name, op), runs in results.items():
        wall = statistics.median(w for w, _ in runs)
        cpu = statistics.median(c for _, c in runs)
        ratio_cpu = ratio_wall = ""
        if name == "kvx mooncake":
            base = results[("mooncake raw", op)]
            ratio_cpu = (
                f"{statistics.median(b[1] / max(k[1], 1e-9) for b, k in zip(base, runs)):.2f}"
            )
            ratio_wall = f"{statistics.median(b[0] / k[0] for b, k in zip(base, runs)):.2f}"
        print(
            f"| {name} | {op} | {wall * 1e3:.1f} | {cpu * 1e3:.1f} | "
            f"{nbytes / wall / 1e9:.2f} | {ratio_cpu} | {ratio_wall} |"
        )


if __name__ == "__main__":
    main()
