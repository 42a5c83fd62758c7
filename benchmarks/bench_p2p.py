"""Throughput of P2pNcclConnector (CPU plane) against raw pyzmq zero-copy sends and raw gloo
send/recv of the same bytes, P -> D, in the same run.

A prefill process (P) and this process (D) hold real KV caches (NHD, float16) and the
connector's worker of their rank. A connector round: P's worker saves a batch of requests
(`save_kv_layer` per layer: copy the blocks out, PUT each slice to D, synchronously) and D's
worker loads them (`start_load_kv`: wait for every slice, write it into D's blocks). D times
from "go" until its blocks hold the KV, and the bytes are checked. A raw zmq round sends the
same number of messages of the same sizes DEALER -> ROUTER with `copy=False`; a raw gloo round
`dist.send`s them into preallocated tensors. Rounds interleave; medians of `--repeat`, with
each side's CPU seconds beside the wall time.

    python benchmarks/bench_p2p.py               # 8 requests x 1024 tokens x 8 layers: 128 MiB
    python benchmarks/bench_p2p.py --quick       # 4 MiB, for CI
    python benchmarks/bench_p2p.py --plot out.png    # needs matplotlib (the `bench` extra)
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import statistics
import time
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
import zmq
from rich.console import Console
from rich.table import Table
from transfer_bench import QUICK_LABEL, Shape, bench_options, receive, titled

from kvx import (
    EngineContext,
    ForwardContext,
    KVCacheSpec,
    KVConnectorRole,
    KVTransferConfig,
    create_connector,
)
from kvx.layouts import get_layout
from kvx.plugins.p2p.metadata import LoadSpec, P2pMetadata, SaveSpec

TARGET = 0.9
SEND_TYPE = ["PUT_ASYNC"]  # --send-type (a list: set before the prefill process starts)


def free_ports(count: int) -> list[int]:
    sockets, ports = [], []
    for _ in range(count):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        sockets.append(s)
        ports.append(s.getsockname()[1])
    for s in sockets:
        s.close()
    return ports


def worker(shape: Shape, role: str, port: int, seed: int | None) -> tuple[Any, dict]:
    names = tuple(f"model.layers.{i}.attn" for i in range(shape.layers))
    spec = KVCacheSpec(names, shape.heads, shape.head_size, shape.block_size, "float16", "NHD")
    ctx = EngineContext(engine_id=role, model_name="bench", cache=spec)
    extra = {
        "send_type": SEND_TYPE[0],
        "data_plane": "cpu",
        "default_decode_address": f"127.0.0.1:{port}",
    }
    config = KVTransferConfig.from_dict(
        {
            "kv_connector": "P2pNcclConnector",
            "kv_role": role,
            "kv_port": port,
            "kv_buffer_size": 4 * shape.nbytes,
            "kv_connector_extra_config": extra,
        }
    )
    blocks = shape.requests * shape.blocks_per_request
    layout = get_layout("NHD")
    caches = {}
    for i, name in enumerate(names):
        t = layout.allocate(
            blocks, shape.block_size, shape.heads, shape.head_size, dtype=torch.float16
        )
        if seed is None:
            t.zero_()
        else:
            t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(seed + i)))
        caches[name] = t
    connector = create_connector(config, KVConnectorRole.WORKER, ctx)
    connector.register_kv_caches(caches)
    return connector, caches


def blocks_of(shape: Shape, i: int) -> list[int]:
    n = shape.blocks_per_request
    return list(range(i * n, (i + 1) * n))


def prefill(shape: Shape, ports: dict[str, int], send_type: str, conn: Connection) -> None:
    """P: answers "conn", "zmq", "gloo" rounds with its CPU seconds; "stop" ends it."""
    SEND_TYPE[0] = send_type
    connector, caches = worker(shape, "kv_producer", ports["p2p"], seed=7)
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{ports['zmq']}")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{ports['gloo']}", rank=0, world_size=2
    )
    payload = [torch.randn(shape.slice_bytes // 2).half() for _ in range(shape.layers)]
    conn.send("ready")
    while True:
        command = conn.recv()
        if command == "stop":
            break
        kind, tag = command
        cpu = time.process_time()
        if kind == "conn":
            saves = [
                SaveSpec(
                    f"{tag}-{i}",
                    blocks_of(shape, i),
                    shape.tokens,
                    send_type,
                    "127.0.0.1",
                    ports["p2p"],
                )
                for i in range(shape.requests)
            ]
            connector.bind_connector_metadata(P2pMetadata(saves=saves))
            for name, cache in caches.items():
                connector.save_kv_layer(name, cache, None)
            connector.wait_for_save()
            connector.clear_connector_metadata()
        elif kind == "zmq":
            for _ in range(shape.requests):
                for t in payload:
                    dealer.send_multipart(
                        [b"hdr", memoryview(t.view(torch.uint8).numpy())], copy=False
                    )
        else:
            for _ in range(shape.requests):
                for t in payload:
                    dist.send(t, dst=1)
        conn.send(time.process_time() - cpu)
    connector.shutdown()
    dealer.close(0)
    context.term()
    dist.destroy_process_group()


def run(shape: Shape, repeat: int) -> dict[str, list[tuple[float, float, float]]]:
    """Per method, (wall s, D cpu s, P cpu s) per timed round."""
    ports = dict(zip(("p2p", "zmq", "gloo"), free_ports(3)))
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=prefill, args=(shape, ports, SEND_TYPE[0], child), daemon=True)
    proc.start()
    connector, caches = worker(shape, "kv_consumer", ports["p2p"], seed=None)
    expected = worker_values(shape)
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.bind(f"tcp://127.0.0.1:{ports['zmq']}")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{ports['gloo']}", rank=1, world_size=2
    )
    sinks = [torch.empty(shape.slice_bytes // 2, dtype=torch.float16) for _ in range(shape.layers)]
    results: dict[str, list[tuple[float, float, float]]] = {"conn": [], "zmq": [], "gloo": []}
    try:
        receive(parent, proc)
        for round_ in range(repeat + 1):  # round 0 warms up (HELLO, first connections)
            for kind in results:
                for cache in caches.values():
                    cache.zero_()
                tag = f"r{round_}"
                start, cpu = time.perf_counter(), time.process_time()
                parent.send((kind, tag))
                if kind == "conn":
                    loads = [
                        LoadSpec(
                            f"{tag}-{i}",
                            f"{tag}-{i}",
                            blocks_of(shape, i),
                            0,
                            shape.tokens,
                            SEND_TYPE[0],
                            "127.0.0.1",
                            ports["p2p"],
                            1,
                            1,
                        )
                        for i in range(shape.requests)
                    ]
                    connector.bind_connector_metadata(P2pMetadata(loads=loads))
                    connector.start_load_kv(ForwardContext())
                    connector.clear_connector_metadata()
                elif kind == "zmq":
                    frames = [
                        router.recv_multipart(copy=False)
                        for _ in range(shape.requests * shape.layers)
                    ]
                    del frames
                else:
                    for _ in range(shape.requests):
                        for sink in sinks:
                            dist.recv(sink, src=0)
                wall, d_cpu = time.perf_counter() - start, time.process_time() - cpu
                p_cpu = receive(parent, proc)
                if kind == "conn":
                    errors = connector.get_block_ids_with_load_errors()
                    assert not errors, f"load errors in blocks {sorted(errors)[:8]}"
                    for name, cache in caches.items():
                        assert torch.equal(cache, expected[name]), f"{name}: bytes differ"
                if round_:
                    results[kind].append((wall, d_cpu, p_cpu))
        parent.send("stop")
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
        connector.shutdown()
        router.close(0)
        context.term()
        dist.destroy_process_group()
    return results


def worker_values(shape: Shape) -> dict[str, torch.Tensor]:
    """What P's caches hold (same seeds), to check D's blocks against."""
    layout = get_layout("NHD")
    blocks = shape.requests * shape.blocks_per_request
    out = {}
    for i in range(shape.layers):
        t = layout.allocate(
            blocks, shape.block_size, shape.heads, shape.head_size, dtype=torch.float16
        )
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(7 + i)))
        out[f"model.layers.{i}.attn"] = t
    return out


def main() -> None:
    parser = bench_options(__doc__, "4 MiB", "median")
    parser.add_argument("--send-type", choices=("PUT", "PUT_ASYNC"), default="PUT_ASYNC")
    args = parser.parse_args()
    SEND_TYPE[0] = args.send_type
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    shape = Shape(2, 4, 64, 16, 4, 256) if args.quick else Shape(8, 8, 64, 16, 8, 1024)
    results = run(shape, args.repeat)
    gib = shape.nbytes / (1 << 30)
    title = (
        f"P2pNcclConnector (CPU plane, {args.send_type}) vs raw transports, "
        f"{shape.nbytes >> 20} MiB"
    )
    table = Table(title=titled(title, args.quick))
    for col in ("method", "wall ms", "GiB/s", "D cpu s", "P cpu s", "raw zmq / method"):
        table.add_column(col, justify="right")
    medians = {
        k: tuple(statistics.median(r[i] for r in v) for i in range(3)) for k, v in results.items()
    }
    names = {"conn": "P2pNcclConnector", "zmq": "raw pyzmq copy=False", "gloo": "raw gloo"}
    for kind, (wall, d_cpu, p_cpu) in medians.items():
        table.add_row(
            names[kind],
            f"{wall * 1e3:.1f}",
            f"{gib / wall:.2f}",
            f"{d_cpu:.3f}",
            f"{p_cpu:.3f}",
            f"{medians['zmq'][0] / wall:.2f}",
        )
    Console(width=120).print(table)
    ratio = medians["zmq"][0] / medians["conn"][0]
    verdict = "(quick: no verdict)" if args.quick else ("met" if ratio >= TARGET else "NOT met")
    print(f"connector / raw zmq throughput: {ratio:.2f} (want >= {TARGET}) {verdict}")
    print(f"raw zmq / raw gloo throughput: {medians['gloo'][0] / medians['zmq'][0]:.2f}")
    if args.plot:
        plot({names[k]: gib / v[0] for k, v in medians.items()}, args.plot, args.quick)


def plot(rates: dict[str, float], path: str, quick: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(list(rates), list(rates.values()))
    ax.set_ylabel("GiB/s (median)")
    ax.set_title(f"P2P CPU plane vs raw transports{f' - {QUICK_LABEL}' if quick else ''}")
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
