"""Thread CPU of P2pNcclConnector's Python work per round, P and D in one process (CPU plane,
PUT_ASYNC, bench_p2p.py's 128 MiB shape): P's `save_kv_layer` over the layers and its
`wait_for_save`, D's loading thread (`start_load_kv`, the copy into its blocks included) and
D's listener thread (its handling of PUTs). Less noisy than the wall-clock bench on a shared
machine: `time.thread_time` counts only the thread's own CPU. Medians of 14 rounds; D's
blocks are zeroed before and compared with P's after every round.

    python benchmarks/bench_p2p_threads.py
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

import torch
from bench_p2p import free_ports, round_loads, round_saves, worker
from transfer_bench import Shape

from kvx import ForwardContext
from kvx.plugins.p2p.listener import Listener
from kvx.plugins.p2p.metadata import P2pMetadata

ROUNDS, WARM_UP = 16, 2


def main() -> None:
    torch.set_num_threads(1)
    shape = Shape(8, 8, 64, 16, 8, 1024)
    port = free_ports(1)[0]
    decode, dest = worker(shape, "kv_consumer", port, None)
    prefill, caches = worker(shape, "kv_producer", port, 7)
    listener_cpu = [0.0]
    handle = Listener._handle

    def timed_handle(self: Listener, *args: Any) -> None:
        start = time.thread_time()
        try:
            handle(self, *args)
        finally:
            listener_cpu[0] += time.thread_time() - start

    Listener._handle = timed_handle  # type: ignore[method-assign]
    rows: list[tuple[float, ...]] = []
    try:
        for round_ in range(ROUNDS):
            tag = f"r{round_}"
            for cache in dest.values():
                cache.zero_()
            loads = round_loads(shape, tag, "PUT_ASYNC", port)
            load_cpu = [0.0]

            def load(loads: P2pMetadata = loads, out: list[float] = load_cpu) -> None:
                start = time.thread_time()
                decode.bind_connector_metadata(loads)
                decode.start_load_kv(ForwardContext())
                decode.clear_connector_metadata()
                out[0] = time.thread_time() - start

            listener_cpu[0] = 0.0
            loader = threading.Thread(target=load)
            loader.start()
            start = time.thread_time()
            prefill.bind_connector_metadata(round_saves(shape, tag, "PUT_ASYNC", port))
            for name, cache in caches.items():
                prefill.save_kv_layer(name, cache, None)
            saved = time.thread_time()
            prefill.wait_for_save()
            prefill.clear_connector_metadata()
            waited = time.thread_time()
            loader.join(60)
            errors = decode.get_block_ids_with_load_errors()
            assert not errors, f"load errors in blocks {sorted(errors)[:8]}"
            for name, cache in caches.items():
                assert torch.equal(dest[name], cache), f"round {round_}: {name} differs from P's"
            if round_ >= WARM_UP:
                rows.append((saved - start, waited - saved, load_cpu[0], listener_cpu[0]))
    finally:
        Listener._handle = handle  # type: ignore[method-assign]
        prefill.shutdown()
        decode.shutdown()
    names = ("P save_kv_layer x layers", "P wait_for_save", "D loading thread", "D listener thread")
    for i, name in enumerate(names):
        print(f"{name}: {statistics.median(r[i] for r in rows) * 1e3:.2f} ms thread CPU per round")


if __name__ == "__main__":
    main()
