"""NixlConnector in push mode against raw NIXL WRITEs of the same descriptors, P -> D, beside
pull mode and raw READs (`bench_nixl.py`'s case, run in the same invocation).

A prefill process (P) and this process (D) hold real KV caches (HND, bfloat16) and push-mode
connector workers of their TP ranks. Each round P finishes a batch of requests; D's scheduler
and workers register D's blocks with P, P's workers WRITE them (P's loop polls its workers,
as an engine's steps would) and D waits until every worker reported every request received.
Raw NIXL: one agent per rank on the same tensors, the same head-slice descriptor lists (the
pull plan, reversed), one `make_prepped_xfer` WRITE per request and (P rank, D rank) posted
and polled by P. Bytes are checked after every round (every element of D's caches). Medians
of `--repeat` rounds, wall time beside CPU time of D and P (push's copies run in P, inside
NIXL's post, so the target is judged on P's CPU time: raw WRITE CPU / push CPU >= 1.0).

    python benchmarks/bench_nixl_push.py              # 256 MiB per round
    python benchmarks/bench_nixl_push.py --quick      # 8 MiB, for CI
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
from bench_nixl import run_case
from nixl_bench_sides import DecodeSide, caches, context, timed_loads
from rich.console import Console
from rich.table import Table
from transfer_bench import Shape, bench_options, receive, titled

from kvx import (
    EngineContext,
    ForwardContext,
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

TARGET = 1.0
SILENCE_S = 120.0
Sample = tuple[float, float, float]  # wall, D's CPU, P's CPU (seconds)


def push_connector(role: KVConnectorRole, kv_role: str, engine_id: str, ctx: EngineContext) -> Any:
    config = KVTransferConfig.from_dict(
        {
            "kv_connector": "NixlPushConnector",
            "kv_role": kv_role,
            "engine_id": engine_id,
            "kv_connector_extra_config": {"kv_lease_duration": 120},
        }
    )
    return create_connector(config, role, ctx)


def registered(agent: Any, kv: dict[str, torch.Tensor]) -> list[Region]:
    regions = [r for name, t in kv.items() for r in layer_regions(name, get_layout("HND"), t)]
    agent.register_memory([(t.data_ptr(), t.nbytes, 0, "") for t in kv.values()], "DRAM")
    return regions


def serve(sched: Any, workers: list[Any]) -> None:
    sched.set_xfer_handshake_metadata_pp_aware(
        {(0, r): w.get_handshake_metadata() for r, w in enumerate(workers)}
    )


# -- prefill process ---------------------------------------------------------------------------


class RawWriter:
    """P rank `rank`'s raw agent and, per D rank, its WRITE lists (the heads that D rank would
    READ from this one)."""

    def __init__(self, shape: Shape, p_tp: int, d_tp: int, rank: int, kv: dict) -> None:
        self.shape = shape
        self.agent = make_agent(f"rawW-P{rank}-{uuid.uuid4().hex[:6]}", ["UCX"], 0, "127.0.0.1")
        self.regions = registered(self.agent, kv)
        self.p = KVGeometry(p_tp, shape.heads, shape.block_size)
        self.d = KVGeometry(d_tp, shape.heads, shape.block_size)
        self.rank = rank
        self.writes: list[tuple[Any, Any]] = []

    def connect(self, d_md: list[tuple[bytes, list[list[int]]]]) -> None:
        for d_rank, (md, d_regions) in enumerate(d_md):
            name = self.agent.add_remote_agent(md)
            regions = [Region("", 0, b, n, self.shape.num_blocks) for b, n in d_regions]
            for read in plan_reads(self.d, self.p, d_rank).reads:
                if read.remote_tp_rank != self.rank:
                    continue
                n, here = read.num_heads, len(self.p.heads_of(self.rank))
                there = len(self.d.heads_of(d_rank))
                local = block_descs(self.regions, read.remote_head_offset, n, here)
                remote = block_descs(regions, read.local_head_offset, n, there)
                self.writes.append(
                    (
                        self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, "DRAM"),
                        self.agent.prep_xfer_dlist(name, remote, "DRAM"),
                    )
                )

    def post(self) -> list[Any]:
        bpr, nb, nregions = self.shape.blocks_per_request, self.shape.num_blocks, len(self.regions)
        handles = []
        for local, remote in self.writes:
            for i in range(self.shape.requests):
                ids = [r * nb + b for r in range(nregions) for b in range(i * bpr, (i + 1) * bpr)]
                h = self.agent.make_prepped_xfer("WRITE", local, ids, remote, ids)
                self.agent.transfer(h)
                handles.append(h)
        return handles

    def wait(self, handles: list[Any]) -> None:
        while handles:
            left = []
            for h in handles:
                state = self.agent.check_xfer_state(h)
                assert state != "ERR", "raw WRITE failed"
                if state == "DONE":
                    self.agent.release_xfer_handle(h)
                else:
                    left.append(h)
            handles = left


def prefill(shape: Shape, p_tp: int, d_tp: int, conn: Connection) -> None:
    torch.set_num_threads(1)
    engine_id = f"P-{uuid.uuid4().hex[:6]}"
    workers, raws = [], []
    for rank in range(p_tp):
        kv = caches(shape, p_tp, rank, seed=7)
        w = push_connector(
            KVConnectorRole.WORKER, "kv_producer", engine_id, context(engine_id, shape, p_tp, rank)
        )
        w.register_kv_caches(kv)
        workers.append(w)
        raws.append(RawWriter(shape, p_tp, d_tp, rank, kv))
    sched = push_connector(
        KVConnectorRole.SCHEDULER, "kv_producer", engine_id, context(engine_id, shape, p_tp, 0)
    )
    serve(sched, workers)
    d_md = conn.recv()
    for raw in raws:
        raw.connect(d_md)
    conn.send("ready")
    while True:
        if conn.poll(0):
            cmd, arg = conn.recv()
            if cmd == "stop":
                break
            if cmd == "cpu":
                conn.send(time.process_time())
            elif cmd == "raw":
                start = time.perf_counter()
                handles = [raw.post() for raw in raws]
                for raw, hs in zip(raws, handles, strict=True):
                    raw.wait(hs)
                conn.send(time.perf_counter() - start)
            else:  # a batch of requests to hand off
                params = {}
                bpr = shape.blocks_per_request
                for i, rid in enumerate(arg):
                    req = Request(
                        rid,
                        [0] * shape.tokens,
                        max_tokens=1,
                        kv_transfer_params={"do_remote_decode": True},
                        status=RequestStatus.FINISHED_LENGTH_CAPPED,
                    )
                    params[rid] = sched.request_finished(req, list(range(i * bpr, (i + 1) * bpr)))[
                        1
                    ]
                meta = sched.build_connector_meta(SchedulerOutput())
                for w in workers:
                    w.bind_connector_metadata(meta)
                    w.start_load_kv(ForwardContext())
                    w.clear_connector_metadata()
                conn.send(params)
        for w in workers:  # an engine's steps: P's workers post and poll the WRITEs here
            w.get_finished(set())
        time.sleep(0.0002)
    for w in workers:
        w.shutdown()
    sched.shutdown()


# -- decode side -------------------------------------------------------------------------------


class Decode(DecodeSide):
    def __init__(self, shape: Shape, d_tp: int) -> None:
        self.shape, self.d_tp = shape, d_tp
        self.start_connectors(push_connector, f"D-{uuid.uuid4().hex[:6]}")
        serve(self.sched, self.workers)
        self.raw = []
        for rank in range(d_tp):
            agent = make_agent(f"rawW-D{rank}-{uuid.uuid4().hex[:6]}", ["UCX"], 0, "127.0.0.1")
            regions = registered(agent, self.kv[rank])
            self.raw.append((agent, regions))

    def progress_raw(self) -> None:
        for agent, _ in self.raw:
            agent.get_new_notifs()

    def raw_metadata(self) -> list[tuple[bytes, list[list[int]]]]:
        return [
            (a.get_agent_metadata(), [[r.base_addr, r.block_len] for r in regions])
            for a, regions in self.raw
        ]

    def push_round(self, params: dict[str, dict]) -> tuple[float, float]:
        return timed_loads(self.sched, self.workers, self.shape, params)


def ask(conn: Connection, proc: Any, cmd: str, arg: Any = None) -> Any:
    conn.send((cmd, arg))
    return receive(conn, proc, SILENCE_S)


def run_push_case(shape: Shape, p_tp: int, d_tp: int, repeat: int) -> dict[str, list[Sample]]:
    """Every timed round's (wall, D CPU, P CPU) for "push" and "raw WRITE", interleaved."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=prefill, args=(shape, p_tp, d_tp, child), daemon=True)
    proc.start()
    samples: dict[str, list[Sample]] = {"push": [], "raw WRITE": []}
    decode = Decode(shape, d_tp)
    try:
        parent.send(decode.raw_metadata())
        assert receive(parent, proc, SILENCE_S) == "ready"
        for round_ in range(repeat + 1):  # round 0: handshakes and warm-up
            for variant in samples:
                before, cpu0 = ask(parent, proc, "cpu"), time.process_time()
                if variant == "push":
                    rids = [f"r{round_}-{i}" for i in range(shape.requests)]
                    params = ask(parent, proc, "batch", rids)
                    before = ask(parent, proc, "cpu")
                    wall, cpu = decode.push_round(params)
                else:
                    start = time.perf_counter()
                    parent.send(("raw", None))
                    while not parent.poll(0):  # a target progresses too (UCX's wire-up)
                        decode.progress_raw()
                    receive(parent, proc, SILENCE_S)
                    wall, cpu = time.perf_counter() - start, time.process_time() - cpu0
                p_used = ask(parent, proc, "cpu") - before
                decode.check_and_clear()
                if round_:
                    samples[variant].append((wall, cpu, p_used))
        return samples
    finally:
        decode.close()
        parent.send(("stop", None))
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def main() -> None:
    parser = bench_options(__doc__, "8 MiB", "median")
    parser.add_argument("--cases", default="1:1,2:1,1:2", help="P:D TP pairs, comma-separated")
    args = parser.parse_args()
    cases = [tuple(int(n) for n in case.split(":")) for case in args.cases.split(",")]
    shape = Shape(2, 8, 64, 16, 4, 256) if args.quick else Shape(8, 8, 128, 16, 8, 1024)
    title = (
        f"NixlConnector push vs raw NIXL WRITE, pull vs raw READ, {shape.nbytes >> 20} MiB per "
        f"round, medians of {args.repeat} rounds (CPU ms of D+P)"
    )
    table = Table(title=titled(title, args.quick))
    for col in (
        "P:D TP",
        "push ms",
        "raw WRITE ms",
        "pull ms",
        "raw READ ms",
        "CPU push / raw WRITE",
        "CPU pull / raw READ",
        "P CPU ratio raw WRITE / push",
        "load",
        "target",
    ):
        table.add_column(col, justify="right")
    for p_tp, d_tp in cases:
        load = os.getloadavg()[0]
        push = run_push_case(shape, p_tp, d_tp, args.repeat)
        pull = run_case(shape, p_tp, d_tp, args.repeat)
        load = max(load, os.getloadavg()[0])

        def ms(samples: list[Sample], i: int) -> float:
            return statistics.median(s[i] for s in samples) * 1e3

        def cpu(samples: list[Sample]) -> str:
            return f"{ms(samples, 1):.1f}+{ms(samples, 2):.1f}"

        ratio = ms(push["raw WRITE"], 2) / ms(push["push"], 2)
        table.add_row(
            f"{p_tp}:{d_tp}",
            f"{ms(push['push'], 0):.1f}",
            f"{ms(push['raw WRITE'], 0):.1f}",
            f"{ms(pull['connector'], 0):.1f}",
            f"{ms(pull['raw'], 0):.1f}",
            cpu(push["push"]) + " / " + cpu(push["raw WRITE"]),
            cpu(pull["connector"]) + " / " + cpu(pull["raw"]),
            f"{ratio:.2f}",
            f"{load:.1f}",
            f">= {TARGET} (quick: no verdict)"
            if args.quick
            else f">= {TARGET} {'met' if ratio >= TARGET else 'NOT met'}",
        )
    Console(width=170).print(table)


if __name__ == "__main__":
    main()
