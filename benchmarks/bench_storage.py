"""Save and load throughput of the storage and offloading connectors against raw IO.

The same KV bytes (`--requests` prompts of `--tokens` tokens, 16-token blocks scattered over a
vLLM FlashAttention NHD cache twice that size, 8 KV heads, head size 128, bfloat16, `--layers`
layers) are saved and loaded, at the connector level (the worker side: `register_kv_caches`,
`bind_connector_metadata`, `save_kv_layer` / `wait_for_save`, `start_load_kv` /
`wait_for_layer_load`; metadata planned by the scheduler side beforehand; the cases are in
storage_cases.py), by

- SharedStorageConnector on `file://` (a temporary directory) and on `redis://` (a
  redis-server this script starts on a free loopback port and stops at the end), the latter
  twice: values through kvx's RESP client (the default) and through redis-py
  (`redis_client: "redis-py"`): that A/B is reported as medians of wall and CPU time,
- raw baselines on the same bytes: one plain sequential file per layer (write / readinto),
  and pipelined redis-py SET / GET of values of the connector's granularity (one per block,
  every layer), 16 MiB of values per pipeline as the connector groups them,
- the ExampleConnector scheme (in storage_baselines.py, like the raw baselines): one
  safetensors file per layer per request, KV gathered and scattered through a per-token slot
  mapping, the folder (named by the MD5 of the prompt's token ids) named and made for every
  file, as vLLM's example does,
- for scale, not a target: the connector's file IO alone (a plain file per block from / into
  the blocks' regions on the connector's IO threads, no header, checksum or rename),
- OffloadingConnector's CPU tier (store and load of every block) against one plain
  `Tensor.copy_` of the same bytes per layer ("memcpy").

Every variant runs in each round, interleaved; the best of `--repeat` rounds is kept (memcpy
and the CPU tier, which take milliseconds, run 5 times a round). Each round saves fresh prompts
(new keys and files; the previous round's are deleted untimed), as a store mostly writes new
blocks. Loaded bytes are checked against the source after the timed rounds (into zeroed caches).
Files are written without fsync and read back from the page cache, for the connector and the
baselines alike; `--dir` picks where (a tmpfs such as /dev/shm takes the disk out of the
picture). On a shared machine absolute times are noise; the ratios are the result.

    python benchmarks/bench_storage.py            # 32 layers x 8 x 256 tokens: 256 MiB
    python benchmarks/bench_storage.py --quick    # 4 layers x 2 x 256 tokens: 8 MiB
    python benchmarks/bench_storage.py --plot out.png   # needs matplotlib (the `bench` extra)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from functools import partial
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from storage_baselines import (
    Case,
    Memcpy,
    RawBlockFiles,
    RawFiles,
    RawRedis,
    SafetensorsPerLayer,
    drop_files,
    drop_keys,
    make_kv,
    measure_rounds,
    redis_server,
)
from storage_cases import OffloadCase, StorageCase

from kvx.plugins.storage.config import SharedStorageConfig

# -- measuring -----------------------------------------------------------------------------------


def measure(cases: list[Case], repeat: int) -> dict[str, dict[str, float]]:
    """Per case, the best save and load wall time (`save`, `load`), and the medians of wall
    and of this process's CPU time, all threads (`save median`, `save cpu`, ...)."""
    times = measure_rounds(cases, repeat)
    return {
        name: {
            "save": min(kinds["save"]),
            "load": min(kinds["load"]),
            **{f"{k} median": statistics.median(kinds[k]) for k in ("save", "load")},
            **{k: statistics.median(v) for k, v in kinds.items() if k.endswith(" cpu")},
        }
        for name, kinds in times.items()
    }


def client_ab(results: dict[str, dict[str, float]], rounds: int) -> str:
    """The RESP client against redis-py in the same connector on the same values: medians."""
    resp, py = results["kvx redis://"], results["kvx redis:// redis-py"]
    parts = []
    for kind in ("save", "load"):
        wall, cpu = (
            py[f"{kind} median"] / resp[f"{kind} median"],
            py[f"{kind} cpu"] / resp[f"{kind} cpu"],
        )
        parts.append(
            f"{kind} {wall:.2f}x wall ({resp[f'{kind} median'] * 1e3:.1f} vs "
            f"{py[f'{kind} median'] * 1e3:.1f} ms), {cpu:.2f}x CPU "
            f"({resp[f'{kind} cpu'] * 1e3:.1f} vs {py[f'{kind} cpu'] * 1e3:.1f} ms)"
        )
    return (
        f"A/B RESP client vs redis-py (kvx redis://, same values, medians of {rounds} rounds; "
        f"x = redis-py time / RESP time, higher: the RESP client pays): {'; '.join(parts)}"
    )


QUICK_LABEL = "quick (not a result)"  # --quick sizes are too small to judge targets by
TARGETS = (  # (case, baseline, wanted ratio of throughputs)
    ("kvx file://", "raw file", 0.7),
    ("kvx file://", "safetensors per layer", 3.0),
    ("kvx redis://", "raw redis", 0.8),
    ("kvx offload CPU", "copy_ (memcpy)", 0.8),
)


def run(args: argparse.Namespace, console: Console) -> list[tuple[str, str, float, float, float]]:
    """Measure every case; return (case, baseline, save ratio, load ratio, target) per target."""
    kv = make_kv(args.layers, args.requests, args.tokens, args.heads, args.head_size)
    console.print(
        f"{args.layers} layers x {len(kv.all_src)} blocks x {kv.block_bytes // 1024} KiB (K+V, "
        f"{kv.block_size} tokens, {args.heads} heads, head size {args.head_size}, bf16) = "
        f"{kv.nbytes / 2**20:.0f} MiB saved and loaded per case ({args.requests} prompts of "
        f"{args.tokens} tokens); torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"best of {args.repeat}"
    )
    with (
        tempfile.TemporaryDirectory(prefix="kvx-bench-", dir=args.dir) as tmp,
        redis_server() as url,
    ):
        root = Path(tmp)
        on_file = StorageCase(kv, f"file://{root}/kvx", partial(drop_files, root / "kvx"))
        mac = {"integrity": "mac", "mac_secret": "bench-secret-0123456789"}
        on_file_mac = StorageCase(
            kv, f"file://{root}/mac", partial(drop_files, root / "mac"), **mac
        )
        on_redis = StorageCase(kv, url, partial(drop_keys, url, "kvx/*"))
        redis_py = StorageCase(kv, url, partial(drop_keys, url, "kvx/*"), redis_client="redis-py")
        raw_files, raw_redis = RawFiles(kv, root / "raw"), RawRedis(kv, url)
        threads = SharedStorageConfig().io_threads
        block_files = RawBlockFiles(kv, root / "raw-blocks", threads)
        example = SafetensorsPerLayer(kv, root / "safetensors")
        offload, memcpy = OffloadCase(kv), Memcpy(kv)
        cases = [
            Case(
                "raw file",
                raw_files.save,
                raw_files.load,
                None,
                "one file per layer",
                raw_files.fresh,
            ),
            Case(
                "raw file per block",
                block_files.save,
                block_files.load,
                "raw file",
                f"reference, the connector's IO alone: a plain file per block (all layers), "
                f"pwritev / preadv straight from / into the blocks on {threads} threads",
                block_files.fresh,
            ),
            Case(
                "kvx file://",
                on_file.save,
                on_file.load,
                "raw file",
                "SharedStorageConnector",
                on_file.fresh,
                on_file.plan_load,
            ),
            Case(
                "kvx file:// mac",
                on_file_mac.save,
                on_file_mac.load,
                "kvx file://",
                'SharedStorageConnector with integrity: "mac" (keyed BLAKE2b in Python instead '
                "of XXH3 during native IO): the cost of the MAC",
                on_file_mac.fresh,
                on_file_mac.plan_load,
            ),
            Case(
                "safetensors per layer",
                example.save,
                example.load,
                None,
                "vLLM ExampleConnector scheme, file per layer per request",
                example.fresh,
            ),
            Case("raw redis", raw_redis.save, raw_redis.load, None, "pipelined SET/GET per block"),
            Case(
                "kvx redis://",
                on_redis.save,
                on_redis.load,
                "raw redis",
                "SharedStorageConnector",
                on_redis.fresh,
                on_redis.plan_load,
            ),
            Case(
                "kvx redis:// redis-py",
                redis_py.save,
                redis_py.load,
                "raw redis",
                'SharedStorageConnector with redis_client: "redis-py" (no RESP client)',
                redis_py.fresh,
                redis_py.plan_load,
            ),
            Case("copy_ (memcpy)", memcpy.save, memcpy.load, None, "one copy_ per layer", inner=5),
            Case(
                "kvx offload CPU",
                offload.save,
                offload.load,
                "copy_ (memcpy)",
                "OffloadingConnector, scattered blocks <-> CPU slots",
                inner=5,
            ),
        ]
        try:
            results = measure(cases, args.repeat)
            loaders = (
                ("file://", on_file),
                ("file:// mac", on_file_mac),
                ("redis://", on_redis),
                ("redis:// redis-py", redis_py),
            )
            for what, loader in loaders:
                kv.clear_dst()
                loader.load()
                kv.check(kv.dst, kv.all_dst, f"kvx {what}")
            kv.clear_dst()
            block_files.load()
            kv.check(kv.dst, kv.all_dst, "raw file per block")
            kv.clear_dst()
            example.load()
            kv.check(kv.dst, kv.all_dst, "safetensors")
            raw_redis.check()
            offload.check()
        finally:
            closing_all = (
                on_file,
                on_file_mac,
                on_redis,
                redis_py,
                raw_redis,
                block_files,
                offload,
            )
            for closing in closing_all:
                closing.close()

    title = "storage and offloading (throughput ratios: higher is better)"
    table = Table(title=f"{QUICK_LABEL}: {title}" if args.quick else title)
    for col in ("case", "save ms", "save GB/s", "load ms", "load GB/s", "vs", "save x", "load x"):
        table.add_column(col, justify="left" if col in ("case", "vs") else "right")
    for case in cases:
        r = results[case.name]
        base = results[case.baseline] if case.baseline else None
        table.add_row(
            case.name,
            f"{r['save'] * 1e3:.0f}",
            f"{kv.nbytes / r['save'] / 1e9:.2f}",
            f"{r['load'] * 1e3:.0f}",
            f"{kv.nbytes / r['load'] / 1e9:.2f}",
            case.baseline or "",
            f"{base['save'] / r['save']:.2f}" if base else "",
            f"{base['load'] / r['load']:.2f}" if base else "",
        )
    console.print(table)
    for case in cases:
        console.print(f"  {case.name}: {case.note}")
    verdicts = []
    for name, base, want in TARGETS:
        save = results[base]["save"] / results[name]["save"]
        load = results[base]["load"] / results[name]["load"]
        met = "met" if min(save, load) >= want else "NOT met"
        met = "no verdict (quick run)" if args.quick else met
        console.print(
            f"target {name} >= {want}x {base}: save {save:.2f}x, load {load:.2f}x -> {met}"
        )
        verdicts.append((name, base, save, load, want))
        cpu_save = results[base]["save cpu"] / results[name]["save cpu"]
        cpu_load = results[base]["load cpu"] / results[name]["load cpu"]
        console.print(
            f"  CPU time (medians, this process, all threads) {name} vs {base}: "
            f"save {cpu_save:.2f}x, load {cpu_load:.2f}x",
            soft_wrap=True,
        )
    bare, example = results["raw file per block"], results["safetensors per layer"]
    console.print(
        f"for scale: raw file per block vs safetensors per layer: save "
        f"{example['save'] / bare['save']:.2f}x, load {example['load'] / bare['load']:.2f}x "
        "(the same IO with no header, checksum or atomic rename)"
    )
    console.print(client_ab(results, args.repeat), soft_wrap=True)
    console.print("every loaded byte matched the saved bytes")
    return verdicts


def main(argv: list[str] | None = None) -> list[tuple[str, str, float, float, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small size (8 MiB), for CI")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--requests", type=int, default=None, help="prompts in the batch")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per prompt (x16)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=None, help="timed rounds (best is kept)")
    parser.add_argument("--dir", default=None, help="where the files go (default: the tmp dir)")
    parser.add_argument("--plot", metavar="PNG", help="write a bar chart (needs matplotlib)")
    args = parser.parse_args(argv)
    if args.tokens < 16 or args.tokens % 16:
        parser.error(f"--tokens: {args.tokens} is not a positive multiple of the block size 16")
    args.layers = args.layers or (4 if args.quick else 32)
    args.requests = args.requests or (2 if args.quick else 8)
    args.repeat = args.repeat or 5
    console = Console(width=120)
    verdicts = run(args, console)
    if args.plot:
        plot(verdicts, args.plot, args.quick)
        console.print(f"wrote {args.plot}")
    return verdicts


def plot(
    verdicts: list[tuple[str, str, float, float, float]], path: str, quick: bool = False
) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'kvx[bench]'") from None
    names = [f"{name}\nvs {base}" for name, base, *_ in verdicts]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [v[2] for v in verdicts], 0.4, label="save")
    ax.bar([i + 0.2 for i in x], [v[3] for v in verdicts], 0.4, label="load")
    ax.scatter(list(x), [v[4] for v in verdicts], marker="_", s=900, color="black", label="target")
    ax.set_xticks(list(x), names, fontsize=8)
    ax.set_ylabel("throughput ratio (higher is better)")
    title = "kvx storage and offloading vs baselines"
    ax.set_title(f"{QUICK_LABEL}: {title}" if quick else title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
