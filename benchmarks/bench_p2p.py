"""Throughput of P2pNcclConnector (CPU plane) against raw pyzmq zero-copy sends and raw gloo
send/recv of the same bytes, P -> D, in the same run.

A prefill process (P) and this process (D) hold real KV caches (NHD, float16) and the
connector's worker of their rank. What each side does, per (request, layer) slice:

- connector: P's `save_kv_layer` PUTs the slice straight from its blocks (zero-copy ZMQ frames,
  one per K/V half and run of consecutive blocks; PUT_ASYNC: without waiting, `wait_for_save`
  reads D's acks; PUT: waits for them per layer); D's listener keeps the received frames and
  `start_load_kv` copies them into D's blocks: one copy on D, none on P.
- raw pyzmq: P sends one frame of the slice's bytes from a contiguous tensor (DEALER -> ROUTER,
  `copy=False`); D receives it (`copy=False`) and copies it into the request's blocks of a
  destination cache of the same shape as the connector's: one copy on D, none on P.
- raw gloo: P `dist.send`s the same tensor; D `dist.recv`s it into a preallocated contiguous
  tensor and copies that into the destination cache's blocks.

D times from "go" until its blocks hold the KV; after every round (warm-up included) every
element of D's destination is compared with what P sent (it was zeroed before: a round that
moved nothing fails). P's CPU seconds run until D has every byte (the raw rounds wait for a
"done" from D, the connector for D's acks), so ZMQ's background sending counts. Both processes
run torch on one thread (a shared 2-core machine: torch's parallel copies under load cost more
than they save); the load average is printed. Rounds interleave; medians of `--repeat`. The
verdict is the median of per-round ratios (a round's connector and raw zmq runs are back to
back, under the same load); the ratio of the medians is printed beside it.

    python benchmarks/bench_p2p.py               # 8 requests x 1024 tokens x 8 layers: 128 MiB
    python benchmarks/bench_p2p.py --quick       # 2 MiB, for CI
    python benchmarks/bench_p2p.py --no-verify   # verify_transfers off: compare D cpu s
    python benchmarks/bench_p2p.py --plot out.png    # needs matplotlib (the `bench` extra)
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import statistics
import time
import warnings
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
VERIFY = [True]  # verify_transfers (--no-verify: off on both sides)


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
        "verify_transfers": VERIFY[0],
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


def round_saves(shape: Shape, tag: str, send_type: str, port: int) -> P2pMetadata:
    """P's metadata for one round: every request of the shape sent to D's listener at `port`."""
    saves = [
        SaveSpec(f"{tag}-{i}", blocks_of(shape, i), shape.tokens, send_type, "127.0.0.1", port)
        for i in range(shape.requests)
    ]
    return P2pMetadata(saves=saves)


def round_loads(shape: Shape, tag: str, send_type: str, port: int) -> P2pMetadata:
    """D's metadata for the same round: every request loaded whole into the same blocks."""
    loads = [
        LoadSpec(
            f"{tag}-{i}",
            f"{tag}-{i}",
            blocks_of(shape, i),
            0,
            shape.tokens,
            send_type,
            "127.0.0.1",
            port,
            1,
            1,
        )
        for i in range(shape.requests)
    ]
    return P2pMetadata(loads=loads)


def raw_payload(shape: Shape) -> list[torch.Tensor]:
    """Per layer, the contiguous slice-shaped tensor the raw rounds send for every request."""
    layout = get_layout("NHD")
    out = []
    for i in range(shape.layers):
        t = layout.allocate(
            shape.blocks_per_request,
            shape.block_size,
            shape.heads,
            shape.head_size,
            dtype=torch.float16,
        )
        out.append(t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(99 + i))))
    return out


def prefill(
    shape: Shape, ports: dict[str, int], send_type: str, verify: bool, conn: Connection
) -> None:
    """P: answers "conn", "zmq", "gloo" rounds with its CPU seconds; "stop" ends it."""
    SEND_TYPE[0], VERIFY[0] = send_type, verify
    torch.set_num_threads(1)
    connector, caches = worker(shape, "kv_producer", ports["p2p"], seed=7)
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{ports['zmq']}")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{ports['gloo']}", rank=0, world_size=2
    )
    payload = raw_payload(shape)
    done = torch.zeros(1)
    conn.send("ready")
    while True:
        command = conn.recv()
        if command == "stop":
            break
        kind, tag = command
        cpu = time.process_time()
        if kind == "conn":
            connector.bind_connector_metadata(round_saves(shape, tag, send_type, ports["p2p"]))
            for name, cache in caches.items():
                connector.save_kv_layer(name, cache, None)
            connector.wait_for_save()
            connector.clear_connector_metadata()
        elif kind == "zmq":
            for _ in range(shape.requests):
                for t in payload:
                    dealer.send_multipart(
                        [b"hdr", memoryview(t.view(torch.uint8).reshape(-1).numpy())],
                        copy=False,
                    )
            dealer.recv()  # D has every byte: ZMQ's sending is in P's CPU time too
        else:
            for _ in range(shape.requests):
                for t in payload:
                    dist.send(t, dst=1)
            dist.recv(done, src=1)
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
    proc = ctx.Process(
        target=prefill, args=(shape, ports, SEND_TYPE[0], VERIFY[0], child), daemon=True
    )
    proc.start()
    torch.set_num_threads(1)
    connector, caches = worker(shape, "kv_consumer", ports["p2p"], seed=None)
    expected = worker_values(shape)
    payload = raw_payload(shape)
    dest = {name: torch.empty_like(cache) for name, cache in caches.items()}
    names = list(caches)
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.bind(f"tcp://127.0.0.1:{ports['zmq']}")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{ports['gloo']}", rank=1, world_size=2
    )
    sink = torch.empty_like(payload[0])
    results: dict[str, list[tuple[float, float, float]]] = {"conn": [], "zmq": [], "gloo": []}
    try:
        receive(parent, proc)
        for round_ in range(repeat + 1):  # round 0 warms up (HELLO, first connections)
            for kind in results:
                for cache in (*caches.values(), *dest.values()):
                    cache.zero_()
                tag = f"r{round_}"
                start, cpu = time.perf_counter(), time.process_time()
                parent.send((kind, tag))
                if kind == "conn":
                    metadata = round_loads(shape, tag, SEND_TYPE[0], ports["p2p"])
                    connector.bind_connector_metadata(metadata)
                    connector.start_load_kv(ForwardContext())
                    connector.clear_connector_metadata()
                elif kind == "zmq":
                    for i in range(shape.requests):
                        for name in names:
                            identity, _, frame = router.recv_multipart(copy=False)
                            land(dest[name], shape, i, frombuffer(frame.buffer, sink))
                else:
                    for i in range(shape.requests):
                        for name in names:
                            dist.recv(sink, src=0)
                            land(dest[name], shape, i, sink)
                wall, d_cpu = time.perf_counter() - start, time.process_time() - cpu
                if kind == "zmq":
                    router.send_multipart([identity.bytes, b"done"])
                elif kind == "gloo":
                    dist.send(torch.ones(1), dst=0)
                p_cpu = receive(parent, proc)
                if kind == "conn":
                    errors = connector.get_block_ids_with_load_errors()
                    assert not errors, f"load errors in blocks {sorted(errors)[:8]}"
                    for name, cache in caches.items():
                        assert torch.equal(cache, expected[name]), f"{name}: bytes differ"
                else:
                    for layer, name in enumerate(names):
                        for i in range(shape.requests):
                            got = dest[name][:, blocks_of(shape, i)]
                            assert torch.equal(got, payload[layer]), f"{kind} {name}: bytes differ"
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


def frombuffer(buffer: memoryview, like: torch.Tensor) -> torch.Tensor:
    """A received frame as a tensor shaped like `like` (read-only: only copied out of)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buffer, dtype=like.dtype).view(like.shape)


def land(cache: torch.Tensor, shape: Shape, i: int, data: torch.Tensor) -> None:
    """Copy request `i`'s slice into its blocks of `cache` (its blocks are consecutive)."""
    n = shape.blocks_per_request
    cache[:, i * n : (i + 1) * n].copy_(data)


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
    parser = bench_options(__doc__, "2 MiB", "median")
    parser.add_argument("--send-type", choices=("PUT", "PUT_ASYNC"), default="PUT_ASYNC")
    parser.add_argument(
        "--no-verify", action="store_true", help="verify_transfers off (its cost: D cpu s)"
    )
    args = parser.parse_args()
    SEND_TYPE[0], VERIFY[0] = args.send_type, not args.no_verify
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    shape = Shape(2, 4, 64, 16, 4, 256) if args.quick else Shape(8, 8, 64, 16, 8, 1024)
    load_before = os.getloadavg()[0]
    results = run(shape, args.repeat)
    load_after = os.getloadavg()[0]
    load = f"load average {load_before:.1f} before, {load_after:.1f} after ({os.cpu_count()} cores)"
    gib = shape.nbytes / (1 << 30)
    title = (
        f"P2pNcclConnector (CPU plane, {args.send_type}, verify_transfers "
        f"{'off' if args.no_verify else 'on'}) vs raw transports, "
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
    # Rounds interleave, so a round's connector and raw zmq runs saw the same machine load:
    # the median of the per-round ratios is the paired (less load-bound) comparison.
    pairs = [z[0] / c[0] for c, z in zip(results["conn"], results["zmq"], strict=True)]
    paired = statistics.median(pairs)
    verdict = "(quick: no verdict)" if args.quick else ("met" if paired >= TARGET else "NOT met")
    print(
        f"connector / raw zmq throughput: {paired:.2f} median of per-round ratios "
        f"({', '.join(f'{p:.2f}' for p in pairs)}), {ratio:.2f} ratio of medians "
        f"(want >= {TARGET}) {verdict}"
    )
    cpu = {k: v[1] + v[2] for k, v in medians.items()}
    print(f"connector / raw zmq CPU seconds (D + P): {cpu['conn'] / cpu['zmq']:.2f}")
    print(f"raw zmq / raw gloo throughput: {medians['gloo'][0] / medians['zmq'][0]:.2f}")
    print(f"medians of {args.repeat} rounds, torch on 1 thread in both processes; {load}")
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
