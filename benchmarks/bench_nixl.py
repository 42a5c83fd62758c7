"""Throughput of NixlConnector against raw NIXL READs of the same descriptors, P -> D.

A prefill process (P) and this process (D) each hold real KV caches (HND, bfloat16) and the
connector's workers of their TP ranks. Each round P finishes a batch of requests (the
connector's `request_finished`, leases and all) and D loads them: scheduler calls, the
handshake (first round only, not timed), READs of every block, notifications to P, until
every D worker reported every request received. In the same run the same bytes move through
raw NIXL: one agent per rank on the same tensors, the same descriptor lists (prepared once,
as the connector does) and one `make_prepped_xfer` READ per request and remote rank, polled
until done. And a memcpy of the same number of bytes inside D's caches (1 thread). Bytes are
checked after every transfer, and the connector's READs must account for every byte of the
round. Rounds interleave; medians of `--repeat` with their range, wall time beside CPU time
(D's process, all its threads, and P's), the machine's load average, and the connector's and
raw NIXL's fraction of memcpy. Both processes run torch on 1 thread. Targets are judged on D's
CPU time (the figure that repeats on a shared machine; the copy runs in D, inside NIXL's
post, and P's CPU is mostly its poll loop, which scales with wall time).

    python benchmarks/bench_nixl.py              # 8 requests x 1024 tokens x 8 layers: 256 MiB
    python benchmarks/bench_nixl.py --quick      # 8 MiB, for CI
    python benchmarks/bench_nixl.py --verify     # verify_transfers on: compare D's CPU
    python benchmarks/bench_nixl.py --plot out.png   # needs matplotlib (the `bench` extra)
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
import uuid
from multiprocessing.connection import Connection
from typing import Any

import torch
from nixl_bench_sides import DecodeSide, caches, context, timed_loads
from rich.console import Console
from rich.table import Table
from transfer_bench import QUICK_LABEL, Shape, bench_options, receive, titled

from kvx import (
    EngineContext,
    ForwardContext,
    KVConnectorOutput,
    KVConnectorRole,
    KVTransferConfig,
    Request,
    RequestStatus,
    SchedulerOutput,
    create_connector,
)
from kvx.layouts import get_layout
from kvx.plugins.nixl.agent import make_agent
from kvx.plugins.nixl.handshake import Region
from kvx.plugins.nixl.regions import block_descs, layer_regions
from kvx.topology import KVGeometry, plan_reads

TARGETS = {True: 1.0, False: 0.9}  # equal TP, heterogeneous TP
PREFILL_SILENCE_S = 120.0  # the longest P may go without a message


CHECKED = {True: " (verify_transfers)", False: ""}  # the plot's label, from --verify
# set from --no-idle-progress / --no-huge-pages (read by both processes)
OPTIONS = {"idle_progress": True, "huge_pages": True}


def connector(role: KVConnectorRole, kv_role: str, engine_id: str, ctx: EngineContext) -> Any:
    config = KVTransferConfig.from_dict(
        {
            "kv_connector": "NixlConnector",
            "kv_role": kv_role,
            "engine_id": engine_id,
            "kv_connector_extra_config": {"kv_lease_duration": 120, **OPTIONS},
        }
    )
    return create_connector(config, role, ctx)


# -- prefill process ---------------------------------------------------------------------------


def prefill(shape: Shape, tp: int, conn: Connection, options: dict[str, bool]) -> None:
    OPTIONS.update(options)
    torch.set_num_threads(1)
    engine_id = f"P-{uuid.uuid4().hex[:6]}"
    workers, raw = [], []
    for rank in range(tp):
        ctx = context(engine_id, shape, tp, rank)
        w = connector(KVConnectorRole.WORKER, "kv_producer", engine_id, ctx)
        kv = caches(shape, tp, rank, seed=7)
        w.register_kv_caches(kv)
        workers.append(w)
        agent = make_agent(f"raw-P{rank}-{uuid.uuid4().hex[:6]}", ["UCX"], 0, "127.0.0.1")
        layout = get_layout("HND")
        regions = [r for name, t in kv.items() for r in layer_regions(name, layout, t)]
        agent.register_memory([(t.data_ptr(), t.nbytes, 0, "") for t in kv.values()], "DRAM")
        raw.append((agent, regions))
    sched = connector(
        KVConnectorRole.SCHEDULER, "kv_producer", engine_id, context(engine_id, shape, tp, 0)
    )
    sched.set_xfer_handshake_metadata_pp_aware(
        {(0, r): w.get_handshake_metadata() for r, w in enumerate(workers)}
    )
    conn.send(
        [
            (a.get_agent_metadata(), [list(map(int, (r.base_addr, r.block_len))) for r in regions])
            for a, regions in raw
        ]
    )
    while True:
        if conn.poll(0):
            cmd = conn.recv()
            if cmd == "stop":
                break
            if cmd == "cpu":  # this process's CPU seconds so far, for D to difference
                conn.send(time.process_time())
                continue
            params = {}
            for i, rid in enumerate(cmd):
                blocks = list(
                    range(i * shape.blocks_per_request, (i + 1) * shape.blocks_per_request)
                )
                req = Request(
                    rid,
                    [0] * shape.tokens,
                    max_tokens=1,
                    kv_transfer_params={"do_remote_decode": True},
                    status=RequestStatus.FINISHED_LENGTH_CAPPED,
                )
                params[rid] = sched.request_finished(req, blocks)[1]
            meta = sched.build_connector_meta(SchedulerOutput())
            digests = None  # verify_transfers: the workers' digests, served by the scheduler
            for w in workers:
                w.bind_connector_metadata(meta)
                w.start_load_kv(ForwardContext())
                w.clear_connector_metadata()
                made = w.build_connector_worker_meta()
                digests = made if digests is None else digests.aggregate(made or digests)
            if digests is not None:
                sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=digests))
            conn.send(params)
        for w in workers:
            w.get_finished(set())
        for agent, _ in raw:
            agent.get_new_notifs()
        time.sleep(0.0002)
    for w in workers:
        w.shutdown()
    sched.shutdown()


# -- decode side -------------------------------------------------------------------------------


class Decode(DecodeSide):
    def __init__(self, shape: Shape, p_tp: int, d_tp: int, raw_md: list, engine: str) -> None:
        self.shape, self.p_tp, self.d_tp = shape, p_tp, d_tp
        self.engine_id = engine
        self.start_connectors(connector, engine)
        self.raw = self._raw_setup(raw_md)

    def _raw_setup(self, raw_md: list) -> list[dict[str, Any]]:
        """Per D rank: an agent on the same tensors, the remote agents and the same
        descriptor lists the connector prepares (per head slice), each prepared once."""
        shape = self.shape
        local = KVGeometry(self.d_tp, shape.heads, shape.block_size)
        remote = KVGeometry(self.p_tp, shape.heads, shape.block_size)
        out = []
        for rank in range(self.d_tp):
            agent = make_agent(f"raw-D{rank}-{uuid.uuid4().hex[:6]}", ["UCX"], 0, "127.0.0.1")
            kv = self.kv[rank]
            layout = get_layout("HND")
            regions = [r for name, t in kv.items() for r in layer_regions(name, layout, t)]
            agent.register_memory([(t.data_ptr(), t.nbytes, 0, "") for t in kv.values()], "DRAM")
            reads = []
            for read in plan_reads(local, remote, rank).reads:
                md, remote_regions = raw_md[read.remote_tp_rank]
                name = agent.add_remote_agent(md)
                rheads = len(remote.heads_of(read.remote_tp_rank))
                lheads = len(local.heads_of(rank))
                rr = [Region("", 0, base, blen, shape.num_blocks) for base, blen in remote_regions]
                rd = agent.prep_xfer_dlist(
                    name, block_descs(rr, read.remote_head_offset, read.num_heads, rheads), "DRAM"
                )
                ld = agent.prep_xfer_dlist(
                    "NIXL_INIT_AGENT",
                    block_descs(regions, read.local_head_offset, read.num_heads, lheads),
                    "DRAM",
                )
                reads.append((ld, rd, len(regions)))
            out.append({"agent": agent, "reads": reads})
        return out

    def connector_round(self, params: dict[str, dict]) -> tuple[float, float]:
        elapsed, cpu = timed_loads(self.sched, self.workers, self.shape, params)
        moved = 0
        for w in self.workers:
            stats = w.get_kv_connector_stats()
            moved += sum(stats.data["bytes_transferred"]) if stats is not None else 0
        assert moved == self.shape.nbytes, (
            f"the connector's READs moved {moved} bytes, not the round's {self.shape.nbytes}"
        )
        return elapsed, cpu

    def raw_round(self) -> tuple[float, float]:
        bpr, nb = self.shape.blocks_per_request, self.shape.num_blocks
        start, cpu = time.perf_counter(), time.process_time()
        handles = []
        for rank in self.raw:
            agent = rank["agent"]
            for ld, rd, nregions in rank["reads"]:
                for i in range(self.shape.requests):
                    ids = [
                        r * nb + b for r in range(nregions) for b in range(i * bpr, (i + 1) * bpr)
                    ]
                    h = agent.make_prepped_xfer("READ", ld, ids, rd, ids)
                    agent.transfer(h)
                    handles.append((agent, h))
        while handles:
            left = []
            for agent, h in handles:
                state = agent.check_xfer_state(h)
                assert state != "ERR", "raw READ failed"
                if state == "DONE":
                    agent.release_xfer_handle(h)
                else:
                    left.append((agent, h))
            handles = left
        return time.perf_counter() - start, time.process_time() - cpu

    def memcpy_round(self) -> tuple[float, float]:
        """The round's bytes copied in this process (1 thread): each layer's first half of
        the used blocks onto its second half, then back; the same caches the READs land in."""
        half = self.shape.requests * self.shape.blocks_per_request // 2
        start, cpu = time.perf_counter(), time.process_time()
        for kv in self.kv:
            for t in kv.values():
                t[:, half : 2 * half].copy_(t[:, :half])
                t[:, :half].copy_(t[:, half : 2 * half])
        return time.perf_counter() - start, time.process_time() - cpu


Sample = tuple[float, float, float]  # wall, D's CPU, P's CPU (seconds)
VARIANTS = ("connector", "raw", "memcpy")


def p_cpu(conn: Connection, proc: Any) -> float:
    conn.send("cpu")
    return float(receive(conn, proc, PREFILL_SILENCE_S))


def run_case(shape: Shape, p_tp: int, d_tp: int, repeat: int) -> dict[str, list[Sample]]:
    """Every timed round's (wall, D CPU, P CPU) per variant; rounds interleave the three."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    args = (shape, p_tp, child, dict(OPTIONS))
    proc = ctx.Process(target=prefill, args=args, daemon=True)
    proc.start()
    samples: dict[str, list[Sample]] = {v: [] for v in VARIANTS}
    try:
        raw_md = receive(parent, proc, PREFILL_SILENCE_S)
        decode = Decode(shape, p_tp, d_tp, raw_md, f"D-{uuid.uuid4().hex[:6]}")
        try:
            for round_ in range(repeat + 1):  # round 0: handshake and warm-up
                parent.send([f"r{round_}-{i}" for i in range(shape.requests)])
                params = receive(parent, proc, PREFILL_SILENCE_S)
                for variant in VARIANTS:
                    before = p_cpu(parent, proc)
                    if variant == "connector":
                        wall, cpu = decode.connector_round(params)
                    elif variant == "raw":
                        wall, cpu = decode.raw_round()
                    else:
                        wall, cpu = decode.memcpy_round()
                    p_used = p_cpu(parent, proc) - before
                    if variant != "memcpy":
                        decode.check_and_clear()  # every element, moved or not
                    else:
                        for kv in decode.kv:
                            for t in kv.values():
                                t.zero_()
                    if round_:
                        samples[variant].append((wall, cpu, p_used))
            return samples
        finally:
            decode.close()
            parent.send("stop")
            proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()


def median(samples: list[Sample], i: int) -> float:
    return statistics.median(s[i] for s in samples)


def cpu_split(samples: list[Sample]) -> str:
    """Median CPU ms of D and of P, as "D+P"."""
    return f"{median(samples, 1) * 1e3:.1f}+{median(samples, 2) * 1e3:.1f}"


def main() -> None:
    parser = bench_options(__doc__, "8 MiB", "median")
    parser.add_argument("--cases", default="1:1,2:2,2:1,1:2", help="P:D TP pairs, comma-separated")
    parser.add_argument(
        "--no-idle-progress",
        action="store_true",
        help="P's connector without its idle progress thread (the before/after comparison)",
    )
    parser.add_argument(
        "--no-huge-pages",
        action="store_true",
        help="the connector leaves the caches on 4 KiB pages (raw NIXL reads the same caches)",
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="verify_transfers on (P digests its blocks, D checks what it read): its D CPU cost",
    )
    args = parser.parse_args()
    OPTIONS["verify_transfers"] = args.verify
    OPTIONS["idle_progress"] = not args.no_idle_progress
    OPTIONS["huge_pages"] = not args.no_huge_pages
    cases = [tuple(int(n) for n in case.split(":")) for case in args.cases.split(",")]
    shape = Shape(8, 8, 128, 16, 8, 1024)
    if args.quick:
        shape = Shape(2, 8, 64, 16, 4, 256)
    gib = shape.nbytes / (1 << 30)
    title = (
        f"NixlConnector vs raw NIXL READ vs memcpy, {shape.nbytes >> 20} MiB per round, "
        f"medians of {args.repeat} rounds"
    )
    table = Table(title=titled(title, args.quick))
    columns = (
        "P:D TP",
        "connector ms [range]",
        "raw NIXL ms [range]",
        "memcpy ms",
        "wall ratio",
        "CPU ms D+P: conn / raw",
        "D CPU ratio",
        "x memcpy wall: conn / raw",
        "x memcpy D CPU: conn / raw",
        "load",
        "target",
    )
    for col in columns:
        table.add_column(col, justify="right")
    rows = []
    for p_tp, d_tp in cases:
        load = os.getloadavg()[0]
        samples = run_case(shape, p_tp, d_tp, args.repeat)
        load = max(load, os.getloadavg()[0])
        conn, raw, copy = (median(samples[v], 0) for v in VARIANTS)
        cpu = {v: median(samples[v], 1) for v in VARIANTS}  # D's: P's is mostly its poll loop
        target = TARGETS[p_tp == d_tp]
        ratio = cpu["raw"] / cpu["connector"]
        rows.append((f"{p_tp}:{d_tp}", conn, raw, copy))
        spread = {}
        for v in VARIANTS:
            walls = [s[0] * 1e3 for s in samples[v]]
            spread[v] = f"{statistics.median(walls):.1f} [{min(walls):.0f}-{max(walls):.0f}]"
        table.add_row(
            f"{p_tp}:{d_tp}",
            spread["connector"],
            spread["raw"],
            f"{copy * 1e3:.1f}",
            f"{raw / conn:.2f}",
            cpu_split(samples["connector"]) + " / " + cpu_split(samples["raw"]),
            f"{ratio:.3f}",
            f"{copy / conn:.2f} / {copy / raw:.2f}",
            f"{cpu['memcpy'] / cpu['connector']:.2f} / {cpu['memcpy'] / cpu['raw']:.2f}",
            f"{load:.1f}",
            f">= {target} (quick: no verdict)"
            if args.quick
            else f">= {target} {'met' if ratio >= target else 'NOT met'}",
        )
    Console(width=170).print(table)
    if args.plot:
        plot(rows, gib, args.plot, args.quick)


def plot(rows: list[tuple[str, float, float, float]], gib: float, path: str, quick: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    checked = CHECKED[OPTIONS["verify_transfers"]]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    x = range(len(rows))
    for k, (offset, label) in enumerate(
        (
            (-0.27, f"NixlConnector{checked}"),
            (0, "raw NIXL READ"),
            (0.27, "memcpy (1 thread)"),
        )
    ):
        ax.bar([i + offset for i in x], [gib / row[k + 1] for row in rows], 0.27, label=label)
    ax.set_xticks(list(x), [row[0] for row in rows])
    ax.set_xlabel("P:D TP")
    ax.set_ylabel("GiB/s (median)")
    ax.set_title(f"NixlConnector{checked} vs raw NIXL READ{f' - {QUICK_LABEL}' if quick else ''}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
