"""LMCache's own engine as a peer on the same bytes: its local CPU and local disk tiers against
kvx's OffloadingConnector and `file://` (run in .venv-vllm, where LMCache 0.5.6 is installed).

`LMCacheTier` drives a raw `LMCacheEngine` (LMCache's defaults except the options named here;
on CPU the paged<->chunk copier is kvx's `PagedCPUConnector`, the only one LMCache can use
without CUDA): `store` / `retrieve` of each request's tokens through its slot mapping. It is
timed to completion and checked so that nothing passes vacuously:

- a local CPU put is synchronous; a local disk put is not (LMCache writes each chunk on its
  disk threads and only then indexes it), so `save` returns once the tier indexes every chunk
  of the round (polling its index), bounded by `SAVE_TIMEOUT_S`;
- every round stores fresh prompts into an emptied tier (CPU: `clear()`; disk: the previous
  round's chunks removed), and `save` checks the tier then holds exactly the round's chunks
  (LMCache drops chunks when its memory is short, with only a log line);
- `load` requires every token back, and the caller checks the loaded bytes.

Run as a script it measures one shape (`--layers`, `--block-size`, `--requests`, `--tokens`)
in interleaved rounds - LMCache local CPU, kvx OffloadingConnector, LMCache local disk, kvx
`file://` - on `--threads` threads (torch, LMCache's disk IO, kvx's IO), and prints one JSON
object: per case the CPU time (this process, all threads) and wall time of each timed round
(round 0 warms up), plus the load average. `bench_storage_sweep.py` runs it per shape.

    .venv-vllm/bin/python benchmarks/peer_lmcache.py --layers 8 --block-size 16 \\
        --requests 16 --tokens 256 --repeat 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from functools import partial
from pathlib import Path
from typing import Any, Literal

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

import torch
from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.metadata import LMCacheMetadata

sys.path.insert(0, str(Path(__file__).resolve().parent))
from storage_baselines import KV, freeze_startup_heap, make_kv

from kvx.layouts import NHD
from kvx.plugins.lmcache.engine import destroy_engine
from kvx.plugins.lmcache.paged_copy import PagedCPUConnector
from kvx.plugins.lmcache.worker import prefix_mask, slot_mapping

CHUNK = 256  # LMCache's default chunk size
SAVE_TIMEOUT_S = 120.0
GIB = 1 << 30


def quiet_lmcache() -> None:
    """LMCache logs a line per store and retrieve at INFO: keep warnings and errors."""
    import logging

    for name in list(logging.Logger.manager.loggerDict):
        if name.startswith("lmcache"):
            logging.getLogger(name).setLevel(logging.WARNING)


def chunks_of(tokens: int) -> int:
    return -(-tokens // CHUNK)


class LMCacheTier:
    """A raw LMCache engine on one tier storing `kv.src`'s request blocks and retrieving them
    into `into`'s `kv.dst_blocks` (default `kv.dst`)."""

    def __init__(
        self,
        kv: KV,
        tier: Literal["cpu", "disk"],
        threads: int = 1,
        rounds: int = 8,
        root: Path | None = None,
        into: dict[str, torch.Tensor] | None = None,
        options: dict[str, Any] | None = None,
    ) -> None:
        self.kv, self.tier = kv, tier
        self.into = kv.dst if into is None else into
        self.expected = sum(chunks_of(kv.tokens) for _ in kv.src_blocks)
        nbytes = kv.nbytes + self.expected * CHUNK * 2 * kv.heads * kv.head_size * 2
        settings: dict[str, Any] = {
            "chunk_size": CHUNK,
            "save_unfull_chunk": True,  # requests shorter than a chunk are stored too
            "local_cpu": tier == "cpu",
            # the allocator holds a round's chunks (the disk tier's while they are written)
            "max_local_cpu_size": 1.25 * nbytes / GIB + 0.05,
        }
        if tier == "disk":
            assert root is not None, "the disk tier needs a directory"
            root.mkdir(parents=True, exist_ok=True)
            settings["local_disk"] = f"{root}/"
            # LMCache's disk tier never gives back the size of chunks removed by hand: room
            # for every round, so no round's store is dropped for "space"
            settings["max_local_disk_size"] = (rounds + 1) * nbytes / GIB + 0.05
            settings["extra_config"] = {"disk_io_threads": threads}
        settings.update(options or {})
        self.engine, self.instance = self._build(settings)
        backends = self.engine.storage_manager.storage_backends
        self.backend = backends["LocalCPUBackend" if tier == "cpu" else "LocalDiskBackend"]
        self.src = list(kv.src.values())
        self.dst = [self.into[n] for n in kv.layers]
        bs, n = kv.block_size, kv.tokens
        self.src_slots = {r: slot_mapping(b, bs, n) for r, b in kv.src_blocks.items()}
        self.dst_slots = {r: slot_mapping(b, bs, n) for r, b in kv.dst_blocks.items()}
        self.mask = prefix_mask(kv.tokens, 0)
        self.round = 0
        self.prompts: dict[str, list[int]] = {}

    def _build(self, settings: dict[str, Any]) -> tuple[LMCacheEngine, str]:
        kv = self.kv
        config = LMCacheEngineConfig.from_defaults(**settings)
        metadata = LMCacheMetadata(
            model_name=f"peer-{self.tier}",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=torch.bfloat16,
            kv_shape=(len(kv.layers), 2, CHUNK, kv.heads, kv.head_size),
            chunk_size=CHUNK,
            role="worker",
        )
        copier = PagedCPUConnector(NHD, len(kv.layers), kv.heads, kv.head_size)
        instance = f"kvx-peer-{self.tier}-{uuid.uuid4().hex[:8]}"
        engine = LMCacheEngineBuilder.get_or_create(instance, config, metadata, copier, None, None)
        engine.post_init()
        return engine, instance

    def held(self) -> int:
        """Chunks the tier holds (disk: written and indexed)."""
        index = self.backend.hot_cache if self.tier == "cpu" else self.backend.dict
        return len(index)

    def fresh(self, prompts: dict[str, list[int]] | None = None) -> None:
        """Untimed: drop the previous round's chunks; this round's prompts (`kv.prompts` of
        the next round unless given: fresh tokens, so fresh keys)."""
        if self.tier == "cpu":
            self.engine.clear()
        else:
            self.backend.batched_remove(list(self.backend.dict), force=True)
        if self.held():
            raise SystemExit(f"LMCache {self.tier}: {self.held()} chunks left after clearing")
        self.round += 1
        prompts = prompts or self.kv.prompts(self.round)
        # lists, as LMCache takes tokens cheapest (it converts a tensor to a list per chunk)
        self.prompts = {r: p[: self.kv.tokens] for r, p in prompts.items()}

    def save(self) -> None:
        """Store every request; returns once the tier holds every chunk of the round."""
        for req, tokens in self.prompts.items():
            self.engine.store(
                tokens, mask=self.mask, kvcaches=self.src, slot_mapping=self.src_slots[req]
            )
        if self.tier == "disk":
            deadline = time.monotonic() + SAVE_TIMEOUT_S
            while self.held() < self.expected and time.monotonic() < deadline:
                time.sleep(0.0002)
        if self.held() != self.expected:
            raise SystemExit(
                f"LMCache {self.tier}: holds {self.held()} chunks after storing, expected "
                f"{self.expected} (a dropped or skipped store)"
            )

    def load(self) -> None:
        """Retrieve every request into its destination blocks; every token must come back."""
        for req, tokens in self.prompts.items():
            got = self.engine.retrieve(
                tokens, mask=self.mask, kvcaches=self.dst, slot_mapping=self.dst_slots[req]
            )
            if not bool(got.all()):
                raise SystemExit(
                    f"LMCache {self.tier}: retrieved {int(got.sum())} of {len(tokens)} tokens "
                    f"of {req}"
                )

    def close(self) -> None:
        destroy_engine(self.instance)


def measure(cases: dict[str, Any], kv: KV, repeat: int) -> dict[str, dict[str, list[float]]]:
    """Interleaved rounds of every case: fresh, save, (plan,) clear the destination, load,
    check the bytes. Per case the CPU and wall times of the timed rounds."""
    times: dict[str, dict[str, list[float]]] = {name: {} for name in cases}
    for round in range(repeat + 1):
        if round == 1:
            freeze_startup_heap()
        for name, case in cases.items():
            getattr(case, "fresh", lambda: None)()
            for kind in ("save", "load"):
                if kind == "load":
                    getattr(case, "plan_load", lambda: None)()
                    clear_destination(case, kv)
                start, cpu = time.perf_counter(), time.process_time()
                getattr(case, kind)()
                wall, cpu = time.perf_counter() - start, time.process_time() - cpu
                if round:
                    times[name].setdefault(kind, []).append(cpu)
                    times[name].setdefault(f"{kind} wall", []).append(wall)
            check_destination(case, kv, name)
    return times


def destination(case: Any, kv: KV) -> dict[str, torch.Tensor]:
    return getattr(case, "caches", None) or getattr(case, "into", None) or kv.dst


def clear_destination(case: Any, kv: KV) -> None:
    idx = torch.tensor(kv.all_dst)
    for t in destination(case, kv).values():
        t.index_fill_(1, idx, 0)


def check_destination(case: Any, kv: KV, name: str) -> None:
    kv.check(destination(case, kv), kv.all_dst, name)


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("layers", "block-size", "requests", "tokens", "repeat"):
        parser.add_argument(f"--{name}", type=int, required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dir", default=None, help="where files go (default: the tmp dir)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    quiet_lmcache()
    from storage_baselines import drop_files
    from storage_cases import OffloadCase, StorageCase  # kvx's cases, on the same bytes

    # destination blocks in the source caches' other half: half the memory
    kv = make_kv(args.layers, args.requests, args.tokens, 8, 128, args.block_size, one_cache=True)
    root = Path(tempfile.mkdtemp(prefix="kvx-peer-lmc-", dir=args.dir))
    cases: dict[str, Any] = {}
    load_before = os.getloadavg()[0]
    try:
        cases["LMCache local CPU"] = LMCacheTier(kv, "cpu", args.threads, args.repeat + 1)
        cases["kvx offload CPU"] = OffloadCase(kv)
        cases["LMCache local disk"] = LMCacheTier(
            kv, "disk", args.threads, args.repeat + 1, root / "lmcache"
        )
        cases["kvx file://"] = StorageCase(
            kv,
            f"file://{root}/kvx",
            partial(drop_files, root / "kvx"),
            io_threads=args.threads,  # type: ignore[arg-type]
        )
        times = measure(cases, kv, args.repeat)
    finally:
        for case in cases.values():
            case.close()
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({"times": times, "load": [load_before, os.getloadavg()[0]]}))


if __name__ == "__main__":
    main()
