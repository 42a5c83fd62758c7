"""Contract-level scenarios: idempotence, clean shutdown, stats and events, store/reuse,
topology and layout claims."""

from __future__ import annotations

import copy
import os
import threading
import time
from pathlib import Path
from typing import Any

from kvx import (
    Capability,
    KVConnectorKVEvents,
    KVConnectorRole,
    KVConnectorStats,
    ParallelInfo,
    Request,
    TransferFigures,
    create_connector,
)
from kvx.conformance.harness import PD_ROLES, STORE_PD_PROOF_TOKENS, Harness
from kvx.conformance.scenario import PD_EITHER, check, scenario
from kvx.engine.server import LocalEngine

PD = (Capability.REMOTE_PREFILL,)
BOTH = "kv_both on every engine"


@scenario(
    "idempotent_matching",
    "get_num_new_matched_tokens answers the same, without side effects, when asked again",
    roles="P kv_producer, D kv_consumer (kv_both on both without remote_prefill)",
)
def idempotent_matching(h: Harness) -> None:
    # A connector without P/D hand-off is not given P/D roles: kv_both on both engines.
    roles = PD_ROLES if Capability.REMOTE_PREFILL in h.claims else ("kv_both", "kv_both")
    with h.pair(roles=roles) as pair:
        report = pair.run(
            {"seed": h.prompts([40])["req-0"]},
            2,
            timeout_s=h.fault_timeout_s * 3,
            stall_s=h.options.stall_timeout_s,
            progress=h.progress,
        )
        params = report.results["seed"].kv_transfer_params
        config = pair.decode_config
        assert config.kv_transfer_config is not None
        connector = create_connector(
            config.kv_transfer_config,
            KVConnectorRole.SCHEDULER,
            config.context(ParallelInfo()),
            registry=h.registry,
        )
        try:
            for num_computed in (0, 16):
                request = Request(
                    "probe", h.prompts([40])["req-0"], kv_transfer_params=copy.deepcopy(params)
                )
                before = copy.deepcopy(request.kv_transfer_params)
                answers = [
                    connector.get_num_new_matched_tokens(request, num_computed) for _ in range(3)
                ]
                check(len(set(answers)) == 1, f"answers changed between calls: {answers}")
                check(
                    request.kv_transfer_params == before,
                    "get_num_new_matched_tokens changed the request's kv_transfer_params",
                )
                count, load_async = answers[0]
                check(count is None or count >= 0, f"negative token count {count}")
                check(count != 0 or not load_async, "async load claimed for 0 tokens")
        finally:
            connector.shutdown()


def _fds() -> set[str]:
    try:
        return set(os.listdir("/proc/self/fd"))
    except OSError:  # not Linux: threads are still checked
        return set()


@scenario(
    "clean_shutdown",
    "shutdown leaves no threads, sockets or files open",
    roles="P kv_producer, D kv_consumer (one kv_both engine without a P/D claim)",
)
def clean_shutdown(h: Harness) -> None:
    threads_before = {t.ident for t in threading.enumerate()}
    fds_before = _fds()
    prompts = h.prompts([20, 45, 310])
    if h.claims & PD_EITHER:
        with h.pair() as pair:
            h.run_pair(pair, prompts)
    else:  # one engine runs the prompts (saving or loading what the connector claims)
        with h.engine("kv_both") as engine:
            got = h.run_engine(engine, prompts, 4)
        check(got == h.baseline(prompts, 4), "outputs differ from a single engine's")
    deadline = time.monotonic() + 5
    while True:
        leaked = [
            t.name for t in threading.enumerate() if t.ident not in threads_before and t.is_alive()
        ]
        new_fds = _fds() - fds_before
        if (not leaked and not new_fds) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    check(not leaked, f"threads still running after shutdown: {leaked}")
    check(not new_fds, f"{len(new_fds)} file descriptors still open after shutdown")


@scenario(
    "stats_and_events_shape",
    "stats are reported, reduce to numbers, rebuild from dicts and give the shared "
    "TransferFigures; events are KV cache events",
    any_of=PD_EITHER,
)
def stats_and_events_shape(h: Harness) -> None:
    with h.pair() as pair:
        h.run_pair(pair, h.prompts([33, 70]))
        engines = []
        for handle in (pair.prefill, pair.decode):
            assert isinstance(handle, LocalEngine)
            engines.append(handle.engine)
        _check_stats_and_events(engines)


@scenario(
    "stats_and_events_shape_stored",
    "stats_and_events_shape for a store: one engine stores, a fresh one loads",
    (Capability.STORE_REUSE,),
    roles=BOTH,
)
def stats_and_events_shape_stored(h: Harness) -> None:
    # the longest spans a whole chunk of every store's documented default (LMCache: 256)
    prompts = h.prompts([33, 70, STORE_PD_PROOF_TOKENS], seed=5)
    with h.engine("kv_both") as first:
        h.run_engine(first, prompts, 4)
        with h.engine("kv_both") as second:
            h.run_engine(second, prompts, 4)
            _check_stats_and_events([first, second])


@scenario(
    "stats_and_events_shape_offloaded",
    "stats_and_events_shape for a slower tier: an engine that offloads",
    (Capability.OFFLOAD,),
    roles=BOTH,
)
def stats_and_events_shape_offloaded(h: Harness) -> None:
    with h.engine("kv_both") as engine:
        h.run_engine(engine, h.prompts([33, 70], seed=6), 4)
        _check_stats_and_events([engine])


def _check_stats_and_events(engines: list[Any]) -> None:
    """Every stats object is well formed, and together they report something in the shared
    `TransferFigures` shape (a connector that moved KV and says nothing fails)."""
    reported = False
    for engine in engines:
        connector = engine.workers[0].connector
        assert connector is not None
        cls = type(connector)
        for stats in engine.kv_stats:
            check(
                isinstance(stats, KVConnectorStats),
                f"{cls.__name__} returned stats of type {type(stats).__name__}",
            )
            reduced = stats.reduce()
            check(
                all(isinstance(v, (int, float)) for v in reduced.values()),
                f"reduce() must give numbers, got {reduced}",
            )
            rebuilt = cls.build_kv_connector_stats(stats.to_dict())
            check(
                rebuilt is not None and rebuilt.to_dict() == stats.to_dict(),
                f"{cls.__name__}.build_kv_connector_stats does not rebuild its stats",
            )
            figures = stats.figures_by_connector(cls.__name__)
            check(
                all(isinstance(f, TransferFigures) for f in figures.values()),
                f"{cls.__name__} stats: figures_by_connector() must give TransferFigures",
            )
            reported |= any(not f.is_empty() for f in figures.values())
        for events in engine.kv_events:
            check(
                isinstance(events, KVConnectorKVEvents),
                f"events of type {type(events).__name__}",
            )
    check(
        reported,
        "the connector moved KV but reported no stats in the shared shape: "
        "get_kv_connector_stats() gave nothing, or its stats' figures() are empty",
    )


@scenario(
    "store_and_reuse",
    "what one engine stored, a fresh engine loads: the hit is counted, output exact",
    (Capability.STORE_REUSE,),
    roles=BOTH,
)
def store_and_reuse(h: Harness) -> None:
    store_then_load(h, h.prompts([300, 150, 40], seed=21))


def _store(h: Harness, prompts: dict[str, list[int]], **engine: Any) -> None:
    """A fresh engine (with `engine` overrides) runs `prompts`, storing their KV, and stops."""
    with h.engine("kv_both", **engine) as first:
        h.run_engine(first, prompts, 4)


def store_then_load(
    h: Harness,
    prompts: dict[str, list[int]],
    store: dict[str, Any] | None = None,
    load: dict[str, Any] | None = None,
) -> None:
    """One engine stores `prompts`' KV, a fresh engine (of another shape when `store` / `load`
    override engine fields) loads it; outputs exact, every KV byte checked, the hit counted.
    The loading engine first runs the first two blocks of the first prompt (loading or
    computing them), so that prompt then mixes a local prefix-cache hit with the external
    load after it. One engine at a time: some stores allow one per process."""
    store, load = store or {}, load or {}
    where = f"stored by {store}, loaded by {load}: " if store or load else ""
    model = {k: v for k, v in load.items() if k in ("num_kv_heads", "dtype")}
    expected = h.baseline(prompts, 4, **model)
    first = next(iter(prompts.values()))
    local = 2 * load.get("block_size", h.base.block_size)
    _store(h, prompts, **store)
    with h.engine("kv_both", **load) as second:
        if len(first) > 2 * local:  # its two blocks are in the prefix cache from now on
            h.run_engine(second, {"local-prefix": [*first[:local], 1, 2, 3]}, 1)
        hits_before = second.stats()["prefix_hit_tokens"]
        loaded_before = second.stats()["external_tokens"]
        got = h.run_engine(second, prompts, 4)  # checks every KV byte after every step
        check(
            got == expected,
            f"{where}outputs after loading stored KV differ: {got} != {expected}",
        )
        check(
            second.stats()["external_tokens"] > loaded_before,
            f"{where}the second engine loaded nothing: stored KV was not found",
        )
        if len(first) > 2 * local:
            check(
                second.stats()["prefix_hit_tokens"] - hits_before >= local,
                f"{where}no local prefix-cache hit ({second.stats()}); the scenario needs one",
            )


@scenario(
    "offload_and_reload",
    "KV kept in a slower tier is loaded back into the same engine after its blocks were "
    "evicted, through preemptions; output exact, no thread left behind",
    (Capability.OFFLOAD,),
    roles=BOTH,
)
def offload_and_reload(h: Harness) -> None:
    threads_before = {t.ident for t in threading.enumerate()}
    target = h.prompts([120, 70], seed=31)
    fillers = h.prompts([100, 90, 110, 95], seed=32, name="filler")
    # Long decodes push the targets' blocks out of the engine and force preemptions.
    stats = h.offload_then_reload(
        target, fillers, num_blocks=24, filler_tokens=40, max_num_batched_tokens=128
    )
    check(stats["preemptions"] > 0, f"no preemption happened ({stats}); the scenario needs one")
    leaked = [
        t.name for t in threading.enumerate() if t.ident not in threads_before and t.is_alive()
    ]
    check(not leaked, f"threads still running after shutdown: {leaked}")


def _distinct_files(root: Path, min_size: int) -> list[Path]:
    """The regular files under `root` of at least `min_size` bytes, each file once however
    many names (hard links) it has: a store may keep several values in one file."""
    seen: dict[tuple[int, int], Path] = {}
    for path in sorted(root.rglob("*")):
        st = path.stat()
        if path.is_file() and st.st_size >= min_size:
            seen.setdefault((st.st_dev, st.st_ino), path)
    return list(seen.values())


def _data_stretches(path: Path) -> list[tuple[int, int]]:
    """The (start, end) byte ranges of `path` that hold data, holes left out (a store may
    leave a hole, e.g. before a file's payloads); the whole file where holes are not known."""
    stretches: list[tuple[int, int]] = []
    fd = os.open(path, os.O_RDONLY)
    try:
        size, at = os.fstat(fd).st_size, 0
        while at < size:
            try:
                start = os.lseek(fd, at, os.SEEK_DATA)
            except OSError:  # no data after `at` (ENXIO)
                break
            at = min(os.lseek(fd, start, os.SEEK_HOLE), size)
            stretches.append((start, at))
    finally:
        os.close(fd)
    return stretches or [(0, os.path.getsize(path))]


@scenario(
    "corrupted_bytes_detected",
    "stored bytes corrupted on disk are detected, reported as load errors, never served",
    (Capability.STORE_REUSE, Capability.DETECTS_CORRUPTION),
    roles=BOTH,
)
def corrupted_bytes_detected(h: Harness) -> None:
    prompts = h.prompts([80, 150], seed=23)
    expected = h.baseline(prompts, 4)
    _store(h, prompts)
    files = _distinct_files(h.workdir, min_size=65)
    check(
        bool(files),
        f"no stored files under {h.workdir} to corrupt: point the connector's "
        "storage at '{tmp}' for this scenario",
    )
    for path in files:
        data = bytearray(path.read_bytes())
        for start, end in _data_stretches(path):  # holes hold no stored bytes
            middle = (start + end) // 2
            data[middle : middle + 8] = bytes(b ^ 0xFF for b in data[middle : middle + 8])
        path.write_bytes(bytes(data))
    h.kv = h.kv_with(kv_load_failure_policy="recompute")
    with h.engine("kv_both") as second:
        got = h.run_engine(second, prompts, 4)  # checks every KV byte after every step
        check(got == expected, f"outputs after corrupted loads differ: {got} != {expected}")
        check(
            second.stats()["load_errors"] > 0,
            "corrupted blocks were not reported through get_block_ids_with_load_errors",
        )


@scenario(
    "hetero_tp",
    "P and D with different TP sizes: 1:2, 2:1, 2:4, 4:2, and 4:4 with replicated KV heads",
    (*PD, Capability.HETERO_TP),
    timeout_s=300,
)
def hetero_tp(h: Harness) -> None:
    for tp, heads in (((1, 2), 4), ((2, 1), 4), ((2, 4), 4), ((4, 2), 4), ((4, 4), 2)):
        with h.pair(tp=tp, num_kv_heads=heads) as pair:
            h.run_pair(pair, h.prompts([37, 64]))


@scenario(
    "block_size_mismatch",
    "P and D with different block sizes: 16->32 and 32->16",
    (*PD, Capability.BLOCK_SIZE_MISMATCH),
)
def block_size_mismatch(h: Harness) -> None:
    for sizes in ((16, 32), (32, 16)):
        with h.pair(block_sizes=sizes) as pair:
            h.run_pair(pair, h.prompts([37, 64, 5]))


@scenario(
    "layout_conversion",
    "P and D with different KV layouts (NHD, HND, CPU packed)",
    (*PD, Capability.LAYOUT_CONVERSION),
)
def layout_conversion(h: Harness) -> None:
    for layouts in (("NHD", "HND"), ("HND", "NHD"), ("NHD", "CPU_PACKED")):
        with h.pair(layouts=layouts) as pair:
            h.run_pair(pair, h.prompts([37, 64]))


@scenario(
    "stored_hetero_tp",
    "what an engine of one TP size stored, an engine of another TP size loads: 1:2, 2:1, 2:4, "
    "4:2, and 4:4 with replicated KV heads",
    (Capability.STORE_REUSE, Capability.HETERO_TP),
    timeout_s=300,
    roles=BOTH,
)
def stored_hetero_tp(h: Harness) -> None:
    cases = (((1, 2), 4), ((2, 1), 4), ((2, 4), 4), ((4, 2), 4), ((4, 4), 2))
    for i, ((p, d), heads) in enumerate(cases):  # fresh prompts: each case loads its own store
        store_then_load(
            h,
            h.prompts([37, 64], seed=410 + i),
            {"tp_size": p, "num_kv_heads": heads},
            {"tp_size": d, "num_kv_heads": heads},
        )


@scenario(
    "stored_block_size_mismatch",
    "what an engine with one block size stored, an engine with another loads: 16->32, 32->16",
    (Capability.STORE_REUSE, Capability.BLOCK_SIZE_MISMATCH),
    roles=BOTH,
)
def stored_block_size_mismatch(h: Harness) -> None:
    for i, (p, d) in enumerate(((16, 32), (32, 16))):
        prompts = h.prompts([37, 64, 70], seed=430 + i)
        store_then_load(h, prompts, {"block_size": p}, {"block_size": d})


@scenario(
    "stored_layout_conversion",
    "what an engine with one KV layout stored, an engine with another loads (NHD, HND, CPU packed)",
    (Capability.STORE_REUSE, Capability.LAYOUT_CONVERSION),
    roles=BOTH,
)
def stored_layout_conversion(h: Harness) -> None:
    for i, (p, d) in enumerate((("NHD", "HND"), ("HND", "NHD"), ("NHD", "CPU_PACKED"))):
        store_then_load(h, h.prompts([37, 64], seed=470 + i), {"layout": p}, {"layout": d})
