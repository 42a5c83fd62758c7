"""What the SharedStorageConnector's scheduler side costs to find stored prefixes, against the
least a lookup can do: one existence check per stored value.

vLLM asks the connector (`get_num_new_matched_tokens`) for every waiting request in its
scheduler loop, so this cost stalls the whole engine, not one request. Per store (`file://` on
a temporary directory; `redis://` on a private redis-server with `--redis`), a batch of
requests of 2 blocks each (8 layers, 16-token blocks, 8 KV heads of 128, bfloat16) is stored,
then planned:

- `kvx hits`: every block stored (the scheduler finds the partition the values were written
  under, then checks the rest of each request under it);
- `kvx misses`: fresh prompts, nothing stored;
- `one check per value` (the baseline): `os.path.exists` of every stored value's file, or one
  pipelined `EXISTS` per value, as many as the hits found.

CPU time of this process, one thread, median of `--repeat` rounds with the range.

    python benchmarks/bench_lookup.py
    python benchmarks/bench_lookup.py --requests 256 --redis
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from statistics import median

import redis
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from storage_baselines import drop_files, drop_keys, freeze_startup_heap, make_kv, redis_server
from storage_cases import StorageCase, plan_step


def cpu_ms(fn: Callable[[], object], repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        start = time.process_time()
        fn()
        times.append((time.process_time() - start) * 1e3)
    return times


def measure(
    url: str, requests: int, repeat: int, drop: Callable[[], None]
) -> dict[str, list[float]]:
    kv = make_kv(8, requests, 32, 8, 128, 16, one_cache=True)
    case = StorageCase(kv, url, drop, io_threads=1)  # type: ignore[arg-type]
    try:
        case.fresh()
        case.save()
        misses = kv.prompts(10_000)  # never stored
        if url.startswith("file://"):
            root = Path(url.removeprefix("file://"))
            values = [str(p) for p in root.glob("*/*/*/*")]

            def baseline() -> object:
                return [os.path.exists(v) for v in values]
        else:
            client = redis.Redis.from_url(url)
            values = client.keys("kvx/*")

            def baseline() -> object:
                pipe = client.pipeline(transaction=False)
                for v in values:
                    pipe.exists(v)
                return pipe.execute()

        if not values:
            raise SystemExit(f"{url}: nothing was stored; no lookup to measure")
        freeze_startup_heap()
        return {
            "kvx hits": cpu_ms(
                partial(plan_step, case.scheduler, case.prompts, kv.dst_blocks), repeat
            ),
            "kvx misses": cpu_ms(partial(plan_step, case.scheduler, misses, kv.dst_blocks), repeat),
            f"one check per value ({len(values)})": cpu_ms(baseline, repeat),
        }
    finally:
        gc.unfreeze()
        case.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=64, help="requests of 2 blocks each")
    parser.add_argument("--repeat", type=int, default=7, help="timed rounds (median)")
    parser.add_argument("--redis", action="store_true", help="also redis:// (a private server)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {}
    with tempfile.TemporaryDirectory(prefix="kvx-lookup-") as tmp:
        url = f"file://{tmp}/store"
        results["file://"] = measure(
            url, args.requests, args.repeat, partial(drop_files, Path(tmp) / "store")
        )
    if args.redis:
        with redis_server() as url:
            results["redis://"] = measure(
                url, args.requests, args.repeat, partial(drop_keys, url, "kvx/*")
            )
    print(
        f"{args.requests} requests of 2 blocks; CPU ms per planning of all of them, "
        f"median of {args.repeat} (range)"
    )
    print("| store | case | CPU ms | per request, us | baseline / case |")
    print("|---|---|---|---|---|")
    for store, cases in results.items():
        base = median(next(t for name, t in cases.items() if name.startswith("one check")))
        for name, times in cases.items():
            mid = median(times)
            print(
                f"| {store} | {name} | {mid:.2f} ({min(times):.2f}-{max(times):.2f}) | "
                f"{mid / args.requests * 1e3:.0f} | {base / mid:.2f} |"
            )


if __name__ == "__main__":
    main()
