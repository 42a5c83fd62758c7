"""What kvx's stats cost: the storage and offloading connectors' save and load with their stats
recording on and off, and the vLLM adapter's Prometheus `observe` per engine step.

"Off" replaces the recording calls (the storage worker's tally, the CPU tier's counters) with
no-ops; everything else is the same code on the same bytes (the cases of storage_cases.py: 8
layers, 8 prompts of 256 tokens, 16-token blocks, bfloat16: 64 MiB). The A/B is paired so the
machine's load cancels: each round runs on and off back to back in one process (alternating
which goes first), each measured as process CPU time with torch on 1 thread, and the round's
ratio on/off is taken; the rounds' median ratio is reported with its 95% confidence interval
(order statistics of the paired ratios, no assumption about their spread). The `file://`
store is on /dev/shm when it exists, so disk IO adds no noise (and the stats' share of the
smaller work is an upper bound).

    python benchmarks/bench_stats.py              # 15 rounds
    python benchmarks/bench_stats.py --rounds 3   # quicker
The Prometheus part runs where vLLM is installed (.venv-vllm), else it is skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import resource
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import torch
from storage_baselines import drop_files, make_kv
from storage_cases import OffloadCase, StorageCase

from kvx.plugins.offload.stats import OffloadStats
from kvx.plugins.storage.stats import Tally


@contextlib.contextmanager
def stats_off() -> Iterator[None]:
    """The connectors' recording calls as no-ops."""
    saved = (Tally.add, Tally.timed, OffloadStats.count, OffloadStats.add)
    Tally.add = lambda self, **counts: None  # type: ignore[method-assign]
    Tally.timed = lambda self, key, seconds: None  # type: ignore[method-assign]
    OffloadStats.count = lambda self, *a, **k: None  # type: ignore[method-assign]
    OffloadStats.add = lambda self, key, n: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        Tally.add, Tally.timed, OffloadStats.count, OffloadStats.add = saved  # type: ignore[method-assign]


@contextlib.contextmanager
def counting(calls: dict[str, int]) -> Iterator[None]:
    """Count the recording calls made inside (they still record)."""
    saved = (Tally.add, Tally.timed, OffloadStats.count, OffloadStats.add)

    def wrap(name: str, func: Callable[..., None]) -> Callable[..., None]:
        def counted(*args: object, **kwargs: object) -> None:
            calls[name] = calls.get(name, 0) + 1
            func(*args, **kwargs)

        return counted

    Tally.add = wrap("Tally.add", saved[0])  # type: ignore[method-assign]
    Tally.timed = wrap("Tally.timed", saved[1])  # type: ignore[method-assign]
    OffloadStats.count = wrap("OffloadStats.count", saved[2])  # type: ignore[method-assign]
    OffloadStats.add = wrap("OffloadStats.add", saved[3])  # type: ignore[method-assign]
    try:
        yield
    finally:
        Tally.add, Tally.timed, OffloadStats.count, OffloadStats.add = saved  # type: ignore[method-assign]


def per_call_cpu() -> dict[str, float]:
    """CPU seconds of one recording call of each kind (a tight loop of 100,000)."""
    tally, stats, n = Tally(), OffloadStats(), 100_000
    calls: dict[str, Callable[[], None]] = {
        "Tally.add": lambda: tally.add(saved_blocks=8, saved_bytes=1 << 20),
        "Tally.timed": lambda: tally.timed("save_seconds", 0.001),
        "OffloadStats.count": lambda: stats.count("store", 1 << 20, 0.001, 8),
        "OffloadStats.add": lambda: stats.add("load_cpu_tokens", 128),
    }
    out = {}
    for name, call in calls.items():
        start = time.process_time()
        for _ in range(n):
            call()
        out[name] = (time.process_time() - start) / n
        tally.take()
        stats.reset()
    return out


Measured = tuple[float, int]
"""CPU seconds of a step and the involuntary context switches the process took during it."""


def cpu_of(step: Callable[[], None]) -> Measured:
    switches = resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw
    start = time.process_time()
    step()
    cpu = time.process_time() - start
    return cpu, resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw - switches


def plus(*parts: Measured) -> Measured:
    return sum(p[0] for p in parts), sum(p[1] for p in parts)


def median_ci(values: list[float]) -> tuple[float, float, float]:
    """Median and its ~95% distribution-free confidence interval (order statistics)."""
    ordered, n = sorted(values), len(values)
    half = 0.98 * math.sqrt(n)
    low = max(0, math.floor(n / 2 - half) - 1)
    high = min(n - 1, math.ceil(n / 2 + half))
    return statistics.median(ordered), ordered[low], ordered[high]


def bench_connectors(rounds: int) -> None:
    torch.set_num_threads(1)
    kv = make_kv(8, 8, 256, 8, 128)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(dir=shm) as tmp:
        root = Path(tmp)
        storage = StorageCase(kv, f"file://{root}", partial(drop_files, root))
        offload = OffloadCase(kv)
        figures: dict[tuple[str, bool], list[Measured]] = {}
        calls: dict[str, int] = {}
        with counting(calls):  # a warm-up round (untimed), counting the recording calls
            storage.fresh()
            storage.save()
            storage.plan_load()
            storage.load()
            offload.save()
            offload.load()
        for n in range(2 * rounds):
            on = n % 4 in (0, 3)  # pairs (on, off), (off, on), ...: neither always goes first
            with contextlib.nullcontext() if on else stats_off():
                storage.fresh()
                save = cpu_of(storage.save)
                storage.plan_load()
                load = cpu_of(storage.load)
                tier = plus(cpu_of(offload.save), cpu_of(offload.load))
            figures.setdefault(("file:// save + load", on), []).append(plus(save, load))
            figures.setdefault(("offload CPU store + load", on), []).append(tier)
        offload.check()
        storage.close()
        offload.close()
    print(f"CPU time (process, torch 1 thread), {rounds} paired rounds, load {load_avg()}")
    for case in ("file:// save + load", "offload CPU store + load"):
        pairs = list(zip(figures[(case, True)], figures[(case, False)], strict=True))
        on, off = (statistics.median(m[0] for m in figures[(case, f)]) for f in (True, False))
        mid, low, high = median_ci([a[0] / b[0] for a, b in pairs])
        ms = f"stats on {on * 1e3:.2f} ms, off {off * 1e3:.2f} ms"
        print(f"  {case}: {ms}, paired on/off {mid:.3f} (95% CI {low:.3f}-{high:.3f})")
        # pairs in which the process was never preempted: other processes' load left no trace
        clean = [a[0] / b[0] for a, b in pairs if a[1] == b[1] == 0]
        if clean:
            mid, low, high = median_ci(clean)
            share = f"{len(clean)} of {len(pairs)} pairs"
            ci = f"95% CI {low:.3f}-{high:.3f}"
            print(f"    unpreempted pairs ({share}): on/off {mid:.3f} ({ci})")
        else:
            print(f"    unpreempted pairs (0 of {len(pairs)} pairs): none")
    cost = per_call_cpu()
    for case, kinds in (
        ("file:// save + load", ("Tally.add", "Tally.timed")),
        ("offload CPU store + load", ("OffloadStats.count", "OffloadStats.add")),
    ):
        spent = sum(calls.get(k, 0) * cost[k] for k in kinds)
        share = spent / statistics.median(m[0] for m in figures[(case, False)])
        made = ", ".join(f"{calls.get(k, 0)} x {k} ({cost[k] * 1e6:.2f} us)" for k in kinds)
        print(f"  {case}: recording calls per round {made} = {spent * 1e6:.0f} us, {share:.2%}")


def bench_prometheus(calls: int) -> None:
    try:
        from prometheus_client import Counter, Gauge, Histogram

        from kvx.adapters.vllm_prom import KvxPromMetrics
        from kvx.plugins.storage.stats import StorageStats
    except ImportError as exc:
        print(f"Prometheus observe: skipped ({exc})")
        return

    class Config:
        kv_transfer_config = None

    prom = KvxPromMetrics(
        Config(),
        {Counter: Counter, Gauge: Gauge, Histogram: Histogram},
        ["model_name", "engine"],
        {0: ["bench", "0"]},
        lambda data: StorageStats(data),
        "SharedStorageConnector",
    )
    step = {  # one busy step: 8 loads and 8 write groups
        "loaded_tokens": 2048,
        "loaded_blocks": 128,
        "loaded_bytes": 1 << 25,
        "saved_blocks": 128,
        "saved_bytes": 1 << 25,
        "load_seconds": [0.004] * 8,
        "save_seconds": [0.006] * 8,
    }
    start = time.process_time()
    for _ in range(calls):
        prom.observe(step, 0)
    per_call = (time.process_time() - start) / calls
    where = "API server process, once per engine step"
    print(f"Prometheus observe ({where}): {per_call * 1e6:.1f} us CPU per step")


def bench_request_facts(requests: int) -> None:
    """The vLLM adapter's per-request facts: one request's whole life on the scheduler side
    (arrival, a 16-block load, its report, the finish with its JSON log line)."""
    import logging

    from kvx.adapters.request_facts import REQUEST_LOG, RequestFacts
    from kvx.contract.types import KVCacheBlocks, KVCacheSpec, Request

    cache = KVCacheSpec(tuple(f"l{i}" for i in range(8)), 8, 128, 16, "bfloat16")
    facts = RequestFacts("SharedStorageConnector", "bench", cache, "recompute")
    blocks = KVCacheBlocks((list(range(16)),), (0,))
    handler = logging.StreamHandler(open(os.devnull, "w"))  # noqa: SIM115 (closed below)
    REQUEST_LOG.addHandler(handler)
    REQUEST_LOG.setLevel(logging.INFO)
    REQUEST_LOG.propagate = False
    start = time.process_time()
    for n in range(requests):
        req_id = f"r{n}"
        request = Request(req_id, list(range(256)))
        facts.arrived(req_id)
        facts.matched(req_id, is_async=False)
        facts.allocated(request, blocks, 255)
        facts.sources(req_id, {"storage": 240})
        facts.scheduled([req_id])
        facts.output((), (), set(), None)
        facts.finished(request, list(range(16)), False, None)
    per_request = (time.process_time() - start) / requests
    REQUEST_LOG.removeHandler(handler)
    handler.stream.close()
    where = "scheduler process, log line included"
    print(f"Per-request facts ({where}): {per_request * 1e6:.1f} us CPU per request")


def load_avg() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds: {args.rounds} is not allowed; give 1 or more")
    bench_connectors(args.rounds)
    bench_prometheus(2000)
    bench_request_facts(5000)


if __name__ == "__main__":
    main()
