"""Store and retrieve throughput of LMCacheConnectorV1 against LMCache's own engine.

The same KV bytes (`--requests` prompts of `--tokens` tokens in 16-token blocks scattered over
a vLLM FlashAttention NHD cache, 8 KV heads, head size 128, bfloat16, `--layers` layers) are
stored into and retrieved from LMCache's local CPU tier (256-token chunks) by

- the connector, at the worker level (`bind_connector_metadata` with the scheduler side's
  store / load specs, `wait_for_save`, `start_load_kv`), and
- raw `LMCacheEngine.store` / `retrieve` calls on the same tensors and slot mappings (with the
  same CPU paged<->chunk copier, the only one LMCache can use on CPU): the baseline,

and, for scale on the same bytes, OffloadingConnector's CPU tier (its worker's block copies,
`kvx.layouts.copy_kv_blocks`) and a `file://` round trip of the chunks' bytes (fsspec, one
file per chunk, page cache). Each round runs every variant, interleaved; medians of `--repeat`
rounds, with the process CPU time beside the wall time. Retrieved bytes are checked against
the source. Ratios are the result; absolute numbers on a shared machine are noise.

    .venv-vllm/bin/python benchmarks/bench_lmcache.py [--png out.png]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

import fsspec
import torch

from kvx import EngineContext, KVCacheSpec, KVConnectorRole, KVTransferConfig, ParallelInfo
from kvx.layouts import copy_kv_blocks, get_layout
from kvx.plugins.lmcache.connector import LMCacheConnectorV1
from kvx.plugins.lmcache.metadata import LMCacheMetadata, LoadSpec, StoreSpec
from kvx.plugins.lmcache.worker import prefix_mask, slot_mapping

BLOCK, HEADS, HEAD, CHUNK = 16, 8, 128, 256


def _timed(fn: Callable[[], None]) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--png", default=None, help="write a bar chart here")
    args = parser.parse_args()

    layers = [f"model.layers.{i}.self_attn" for i in range(args.layers)]
    per_req = args.tokens // BLOCK
    num_blocks = 2 * args.requests * per_req
    layout = get_layout("NHD")
    src = {n: layout.allocate(num_blocks, BLOCK, HEADS, HEAD, dtype=torch.bfloat16) for n in layers}
    for t in src.values():
        t.copy_(torch.randn(t.shape, dtype=torch.float32))
    work = {n: torch.zeros_like(t) for n, t in src.items()}  # the engine's cache: stored, loaded
    perm = torch.randperm(num_blocks).tolist()
    blocks = [perm[r * per_req : (r + 1) * per_req] for r in range(args.requests)]
    nbytes = args.requests * args.tokens * args.layers * 2 * HEADS * HEAD * 2
    spec = KVCacheSpec(tuple(layers), HEADS, HEAD, BLOCK, "bfloat16", "NHD")
    extra = {"chunk_size": CHUNK, "max_local_cpu_size": 3 * nbytes / 2**30 + 0.1}

    def connector(tag: str) -> tuple[LMCacheConnectorV1, Any]:
        ktc = KVTransferConfig.from_dict(
            {
                "kv_connector": "LMCacheConnectorV1",
                "kv_role": "kv_both",
                "kv_connector_extra_config": extra,
            }
        )
        ctx = EngineContext(
            engine_id=f"bench-{tag}", model_name=f"bench-{tag}", cache=spec, parallel=ParallelInfo()
        )
        conn = LMCacheConnectorV1(ktc, KVConnectorRole.WORKER, ctx)
        conn.register_kv_caches(work)
        return conn, conn.worker.engine

    conn, _ = connector("kvx")
    raw_conn, raw = connector("raw")  # its own LMCache engine (another model name: other keys)
    tensors = list(work.values())
    rounds: dict[str, list[tuple[float, float]]] = {}
    fs, root = fsspec.core.url_to_fs(f"file://{tempfile.mkdtemp(prefix='kvx-bench-lmc-')}")
    cpu_tier = {n: torch.empty_like(t) for n, t in src.items()}
    flat_blocks = [b for bl in blocks for b in bl]

    for round_ in range(args.repeat):
        prompts = [
            [round_ * 10**6 + r * 10**4 + i for i in range(args.tokens)]
            for r in range(args.requests)
        ]
        # the raw engine gets tokens of its own: LMCache may skip chunks another engine in the
        # process stored already, which would time a store that copies nothing
        raw_prompts = [[t + 5 * 10**5 for t in p] for p in prompts]
        stores = [StoreSpec(f"r{r}", p, blocks[r], 0) for r, p in enumerate(prompts)]
        loads = [LoadSpec(f"r{r}", p, blocks[r], 0, args.tokens) for r, p in enumerate(prompts)]

        def kvx_store() -> None:
            conn.bind_connector_metadata(LMCacheMetadata(stores=stores))  # noqa: B023
            conn.wait_for_save()
            conn.clear_connector_metadata()

        def kvx_load() -> None:
            conn.bind_connector_metadata(LMCacheMetadata(loads=loads))  # noqa: B023
            conn.start_load_kv(None)  # type: ignore[arg-type]
            conn.clear_connector_metadata()
            assert not conn.get_block_ids_with_load_errors()

        def raw_store() -> None:
            for r, p in enumerate(raw_prompts):  # noqa: B023
                raw.store(
                    torch.tensor(p),
                    mask=prefix_mask(len(p), 0),
                    kvcaches=tensors,
                    slot_mapping=slot_mapping(blocks[r], BLOCK, len(p)),
                )

        def raw_load() -> None:
            for r, p in enumerate(raw_prompts):  # noqa: B023
                got = raw.retrieve(
                    torch.tensor(p),
                    mask=prefix_mask(len(p), 0),
                    kvcaches=tensors,
                    slot_mapping=slot_mapping(blocks[r], BLOCK, len(p)),
                )
                assert bool(got.all())

        def offload_store() -> None:
            copy_kv_blocks(work, cpu_tier, flat_blocks, flat_blocks, "d2h", layout=layout)

        def offload_load() -> None:
            copy_kv_blocks(cpu_tier, work, flat_blocks, flat_blocks, "h2d", layout=layout)

        def file_store() -> None:
            for b in flat_blocks:
                data = b"".join(
                    t[:, b].contiguous().view(torch.uint8).numpy().tobytes() for t in work.values()
                )
                with fs.open(f"{root}/{round_}-{b}", "wb") as f:  # noqa: B023
                    f.write(data)

        def file_load() -> None:
            for b in flat_blocks:
                data = bytearray(fs.cat_file(f"{root}/{round_}-{b}"))  # noqa: B023
                per = len(data) // len(work)
                for i, t in enumerate(work.values()):
                    part = torch.frombuffer(
                        data, dtype=torch.bfloat16, offset=i * per, count=per // 2
                    )
                    t[:, b].copy_(part.view(t[:, b].shape))

        for name, fn in (
            ("connector store", kvx_store),
            ("raw LMCacheEngine store", raw_store),
            ("connector retrieve", kvx_load),
            ("raw LMCacheEngine retrieve", raw_load),
            ("OffloadingConnector CPU tier store", offload_store),
            ("OffloadingConnector CPU tier load", offload_load),
            ("file:// store", file_store),
            ("file:// load", file_load),
        ):
            loading = name.endswith(("retrieve", "load"))
            for n, t in work.items():  # untimed: the source bytes, or zeros to load into
                t.zero_() if loading else t.copy_(src[n])
            rounds.setdefault(name, []).append(_timed(fn))
            if loading:
                for n in layers:
                    got, want = work[n][:, flat_blocks], src[n][:, flat_blocks]
                    assert torch.equal(got, want), f"{name}: {n} differs"
        conn.worker.engine.clear()
        raw.clear()
        fs.rm(root, recursive=True)
        fs.makedirs(root, exist_ok=True)

    conn.shutdown()
    raw_conn.shutdown()
    med = {
        k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
        for k, v in rounds.items()
    }
    print(f"{nbytes / 2**20:.0f} MiB per operation, median of {args.repeat} rounds")
    print(f"{'variant':38} {'wall ms':>9} {'cpu ms':>9} {'GB/s':>7} {'vs raw':>7}")
    for name, (wall, cpu) in med.items():
        base = "raw LMCacheEngine " + ("store" if "store" in name else "retrieve")
        ratio = med[base][0] / wall
        print(
            f"{name:38} {wall * 1e3:9.1f} {cpu * 1e3:9.1f} {nbytes / wall / 1e9:7.2f} {ratio:6.2f}x"
        )
    if args.png:
        import matplotlib  # the bench extra; not in .venv-vllm

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 4))
        names = list(med)
        ax.barh(names, [nbytes / med[n][0] / 1e9 for n in names])
        ax.set_xlabel("GB/s (median)")
        ax.invert_yaxis()
        fig.tight_layout()
        fig.savefig(args.png)


if __name__ == "__main__":
    main()
