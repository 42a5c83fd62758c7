"""Store and retrieve throughput of LMCacheConnectorV1 against LMCache's own engine.

The same KV bytes (`--requests` prompts of `--tokens` tokens in `--block-size`-token blocks
scattered over a vLLM FlashAttention NHD cache, 8 KV heads, head size 128, bfloat16,
`--layers` layers; 256 MiB by default) are stored into and retrieved from LMCache's local CPU
tier (256-token chunks) by

- the connector at the worker level (`bind_connector_metadata` with the scheduler side's
  store / load specs, `wait_for_save`, `start_load_kv`), on its own LMCache engine, and
- raw `LMCacheEngine.store` / `retrieve` calls (`peer_lmcache.LMCacheTier`) on another engine
  with the connector's LMCache options, the same tensors and the same slot mappings (and the
  same CPU paged<->chunk copier, the only one LMCache can use on CPU): the baseline,

and, for scale on the same bytes, kvx's OffloadingConnector (CPU tier, worker side) and
SharedStorageConnector on `file://` (a temporary directory, page cache, no fsync).

Soundness: every round stores fresh prompts (tokens no other variant or round used) into an
emptied tier, each store is timed until the tier holds the round's chunks and is checked to
hold exactly those (so a store that copies nothing fails), every token must come back, and
every loaded byte is compared with the source (into zeroed blocks). Rounds are interleaved;
round 0 warms up. Figures: medians of `--repeat` rounds with their range, CPU time of this
process (all threads) beside wall time, on `--threads` threads (default 1: the figures that
repeat on a shared machine), and the load average before and after.

    .venv-vllm/bin/python benchmarks/bench_lmcache.py [--layers 16 --requests 4 --tokens 1024]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_lmcache import CHUNK, GIB, LMCacheTier, chunks_of, measure, quiet_lmcache
from storage_baselines import KV, drop_files, make_kv
from storage_cases import OffloadCase, StorageCase

from kvx import KVConnectorRole, KVTransferConfig
from kvx.plugins.lmcache.config import LMCacheConfig
from kvx.plugins.lmcache.connector import LMCacheConnectorV1
from kvx.plugins.lmcache.metadata import LMCacheMetadata, LoadSpec, StoreSpec

CONNECTOR, RAW = "connector", "raw LMCacheEngine"


def offset_prompts(kv: KV, round: int, offset: int) -> dict[str, list[int]]:
    """Round `round`'s prompts with every token id moved by `offset` (ids < 32000 + offset):
    variants given different offsets never share a token sequence."""
    return {r: [t + offset for t in p[: kv.tokens]] for r, p in kv.prompts(round).items()}


class ConnectorCase:
    """The connector's worker side on `kv.src`: stores the source blocks, loads them back into
    the destination blocks of the same tensors."""

    def __init__(self, kv: KV, extra: dict[str, Any]) -> None:
        self.kv, self.round = kv, 0
        config = KVTransferConfig.from_dict(
            {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
             "kv_connector_extra_config": extra}
        )  # fmt: skip
        ctx = kv.context()
        self.caches = kv.src
        self.connector = LMCacheConnectorV1(config, KVConnectorRole.WORKER, ctx)
        self.connector.register_kv_caches(self.caches)
        engine = self.connector.worker.engine
        self.engine, self.tier = engine, engine.storage_manager.storage_backends["LocalCPUBackend"]
        self.expected = len(kv.src_blocks) * chunks_of(kv.tokens)
        self.stores: list[StoreSpec] = []
        self.loads: list[LoadSpec] = []

    def fresh(self) -> None:
        self.engine.clear()
        if self.tier.hot_cache:
            raise SystemExit(f"connector: {len(self.tier.hot_cache)} chunks left after clear")
        self.round += 1
        kv = self.kv
        prompts = offset_prompts(kv, self.round, 2 * 32000)
        self.stores = [StoreSpec(r, p, kv.src_blocks[r], 0) for r, p in prompts.items()]
        self.loads = [LoadSpec(r, p, kv.dst_blocks[r], 0, kv.tokens) for r, p in prompts.items()]

    def save(self) -> None:
        self.connector.bind_connector_metadata(LMCacheMetadata(stores=self.stores))
        self.connector.wait_for_save()
        self.connector.clear_connector_metadata()
        if len(self.tier.hot_cache) != self.expected:
            raise SystemExit(
                f"connector: holds {len(self.tier.hot_cache)} chunks after storing, expected "
                f"{self.expected}"
            )

    def load(self) -> None:
        self.connector.bind_connector_metadata(LMCacheMetadata(loads=self.loads))
        self.connector.start_load_kv(None)  # type: ignore[arg-type]
        self.connector.clear_connector_metadata()
        if self.connector.get_block_ids_with_load_errors():
            raise SystemExit("connector: load errors")

    def close(self) -> None:
        self.connector.shutdown()


class RawCase(LMCacheTier):
    """The raw engine's rounds on tokens of their own (no other variant stores them)."""

    def fresh(self, prompts: dict[str, list[int]] | None = None) -> None:
        self.engine.get_kv_events()  # the connector drains these each step; so does this
        super().fresh(offset_prompts(self.kv, self.round + 1, 32000))


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def report(times: dict[str, dict[str, list[float]]], nbytes: int) -> list[str]:
    lines = [
        "| variant | CPU ms | wall ms | GB/s (wall) | CPU ratio to raw LMCache | wall ratio |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for kind, verb in (("save", "store"), ("load", "retrieve")):
        raw_cpu, raw_wall = times[RAW][kind], times[RAW][f"{kind} wall"]
        for name, t in times.items():
            cpu, wall = t[kind], t[f"{kind} wall"]
            cpu_ratio = [r / c for r, c in zip(raw_cpu, cpu, strict=True)]
            wall_ratio = [r / w for r, w in zip(raw_wall, wall, strict=True)]
            lines.append(
                f"| {name} {verb} | {statistics.median(cpu) * 1e3:.1f} | "
                f"{statistics.median(wall) * 1e3:.1f} | "
                f"{nbytes / statistics.median(wall) / 1e9:.2f} | **{spread(cpu_ratio)}** | "
                f"{spread(wall_ratio)} |"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch and IO threads")
    parser.add_argument("--dir", default=None, help="where file:// goes (default: tmp dir)")
    args = parser.parse_args()
    if args.tokens % CHUNK:
        parser.error(f"--tokens: {args.tokens} is not a multiple of LMCache's chunk ({CHUNK})")
    torch.set_num_threads(args.threads)
    quiet_lmcache()
    kv = make_kv(args.layers, args.requests, args.tokens, 8, 128, args.block_size)
    tier_gb = 1.25 * kv.nbytes / GIB + 0.05
    extra = {"chunk_size": CHUNK, "max_local_cpu_size": tier_gb}
    raw_options = LMCacheConfig(**extra).lmcache_options()  # type: ignore[arg-type]
    cases: dict[str, Any] = {}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="kvx-bench-lmc-", dir=args.dir) as tmp:
        try:
            cases[CONNECTOR] = ConnectorCase(kv, extra)
            cases[RAW] = RawCase(kv, "cpu", args.threads, into=kv.src, options=raw_options)
            cases["kvx offload CPU"] = OffloadCase(kv)
            cases["kvx file://"] = StorageCase(
                kv, f"file://{tmp}/kvx", partial(drop_files, Path(tmp) / "kvx"),
                io_threads=args.threads,  # type: ignore[arg-type]
            )  # fmt: skip
            times = measure(cases, kv, args.repeat)
        finally:
            for case in cases.values():
                case.close()
    print(
        f"{kv.nbytes / 2**20:.0f} MiB per operation ({args.layers} layers, {args.requests} x "
        f"{args.tokens} tokens, {args.block_size}-token blocks), {args.threads} thread(s), "
        f"medians of {args.repeat} rounds (range); load average {load_before:.1f} -> "
        f"{os.getloadavg()[0]:.1f}; ratios: raw LMCache time / variant time (> 1: faster)"
    )
    print("\n".join(report(times, kv.nbytes)))


if __name__ == "__main__":
    main()
