"""The Redis backend on a 3+3 Redis Cluster against its own raw client, and against one node.

The same bytes (`--values` values per batch, each `--chunks` scattered 32 KiB chunks of a
uint8 "KV cache" behind a 64-byte header, as the connector saves blocks) are saved and loaded
by:

- `kvx cluster`: the backend on the cluster (URL naming one node), keys spread over slots as
  the connector's content-addressed keys are;
- `kvx cluster, one tag`: the same with every key of a batch under one hash tag (`{g<n>}`), so
  one master takes the whole batch in one round trip (the placement alternative);
- `redis-py cluster`: the raw client, RedisCluster's pipeline of SET (the chunks joined) and
  GET (then copied into the chunks), the same bytes;
- `kvx node` / `redis-py node`: the same on one redis-server.

Every variant runs in each round, interleaved; figures are medians over `--rounds` of the
wall time and the CPU time of this process (`time.process_time`, the servers' CPU excluded),
with the ratio raw / kvx per round (>= 0.9 is the target). Loaded bytes are compared with the
saved ones after every load. The servers are this script's own children on loopback; on a
shared machine absolute times are noise, the ratios are the result.

    python benchmarks/bench_redis_cluster.py              # 32 values x 64 chunks: 64 MiB
    python benchmarks/bench_redis_cluster.py --quick      # 8 values x 16 chunks
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import redis
import torch
from redis.cluster import RedisCluster

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))  # the tests' real-server fixtures

from kvx_test_clusters import ClusterProcesses  # noqa: E402
from kvx_test_services import RedisProcess  # noqa: E402

from kvx.plugins.storage.backends.base import BackendOptions, copy_into  # noqa: E402
from kvx.plugins.storage.backends.redis_backend import KEY_PREFIX, RedisBackend  # noqa: E402

CHUNK = 32 << 10
HEADER = 64


class Cache:
    """Random chunks; value i is its header then `chunks` chunks scattered over the cache."""

    def __init__(self, values: int, chunks: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.rows = torch.randint(0, 256, (values * chunks * 2, CHUNK), dtype=torch.uint8)
        self.heads = torch.randint(0, 256, (values, HEADER), dtype=torch.uint8, generator=gen)
        order = torch.randperm(values * chunks * 2, generator=gen)[: values * chunks]
        self.order = order.view(values, chunks)
        self.values = values

    def buffers(self, i: int, rows: torch.Tensor | None = None) -> list[memoryview]:
        rows_np = (self.rows if rows is None else rows).numpy()
        return [
            memoryview(self.heads.numpy()[i]),
            *(memoryview(rows_np[int(r)]) for r in self.order[i]),
        ]


Step = Callable[[list[str]], None]


def kvx_steps(backend: RedisBackend, cache: Cache, into: torch.Tensor) -> tuple[Step, Step]:
    def put(keys: list[str]) -> None:
        backend.put_vectored([(k, cache.buffers(i)) for i, k in enumerate(keys)])

    def get(keys: list[str]) -> None:
        sizes = backend.get_vectored(keys, [cache.buffers(i, into) for i in range(len(keys))])
        assert all(s is not None for s in sizes)

    return put, get


def raw_steps(
    client: redis.Redis | RedisCluster, cache: Cache, into: torch.Tensor
) -> tuple[Step, Step]:
    def put(keys: list[str]) -> None:
        pipe = client.pipeline(transaction=False)
        for i, k in enumerate(keys):
            pipe.set(KEY_PREFIX + k, b"".join(cache.buffers(i)))
        pipe.execute()

    def get(keys: list[str]) -> None:
        pipe = client.pipeline(transaction=False)
        for k in keys:
            pipe.get(KEY_PREFIX + k)
        for i, value in enumerate(pipe.execute()):
            copy_into(cache.buffers(i, into), value)

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
    torch.set_num_threads(1)
    cache = Cache(args.values, args.chunks)
    into = torch.zeros_like(cache.rows)
    nbytes = args.values * (HEADER + args.chunks * CHUNK)
    with ClusterProcesses("redis") as cluster:
        node = RedisProcess()
        try:
            kvx_cluster = RedisBackend(cluster.url, BackendOptions())
            kvx_node = RedisBackend(node.url, BackendOptions())
            raw_cluster = RedisCluster.from_url(cluster.url)
            raw_node = redis.Redis.from_url(node.url)
            variants: dict[str, tuple[tuple[Step, Step], bool]] = {
                "kvx cluster": (kvx_steps(kvx_cluster, cache, into), False),
                "kvx cluster, one tag": (kvx_steps(kvx_cluster, cache, into), True),
                "redis-py cluster": (raw_steps(raw_cluster, cache, into), False),
                "kvx node": (kvx_steps(kvx_node, cache, into), False),
                "redis-py node": (raw_steps(raw_node, cache, into), False),
            }
            results: dict[tuple[str, str], list[tuple[float, float]]] = {}
            for r in range(args.rounds + 1):  # round 0 warms up
                for name, ((put, get), tagged) in variants.items():
                    tag = f"{{g{r}}}/" if tagged else ""
                    keys = [
                        f"bench/{name.replace(' ', '_')}/{tag}r{r}/v{i}" for i in range(args.values)
                    ]
                    into.zero_()
                    p = timed(put, keys)
                    g = timed(get, keys)
                    for i in range(args.values):  # every byte lands where it belongs
                        assert all(
                            bytes(a) == bytes(b)
                            for a, b in zip(cache.buffers(i), cache.buffers(i, into), strict=True)
                            if a.nbytes == CHUNK
                        )
                    if r:
                        results.setdefault((name, "put"), []).append(p)
                        results.setdefault((name, "get"), []).append(g)
                cluster.flush()
                redis.Redis(port=node.port).flushall()
            label = "quick (not a result): " if args.quick else ""
            print(
                f"{label}{args.values} values x ({args.chunks} x 32 KiB + 64 B) = "
                f"{nbytes / 2**20:.0f} MiB "
                f"per batch; medians of {args.rounds} rounds (shared machine)\n"
            )
            print("| variant | op | wall ms | CPU ms | GB/s (wall) | raw/kvx CPU | raw/kvx wall |")
            print("|---|---|---|---|---|---|---|")
            for (name, op), runs in results.items():
                wall = statistics.median(w for w, _ in runs)
                cpu = statistics.median(c for _, c in runs)
                raw = "redis-py cluster" if "cluster" in name else "redis-py node"
                ratio_cpu = ratio_wall = ""
                if name.startswith("kvx"):
                    base = results[(raw, op)]
                    ratio_cpu = f"{statistics.median(b[1] / k[1] for b, k in zip(base, runs)):.2f}"
                    ratio_wall = f"{statistics.median(b[0] / k[0] for b, k in zip(base, runs)):.2f}"
                print(
                    f"| {name} | {op} | {wall * 1e3:.1f} | {cpu * 1e3:.1f} | "
                    f"{nbytes / wall / 1e9:.2f} | {ratio_cpu} | {ratio_wall} |"
                )
            for client in (kvx_cluster, kvx_node, raw_cluster, raw_node):
                client.close()
        finally:
            node.kill()


if __name__ == "__main__":
    main()
