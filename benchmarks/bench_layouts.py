"""Throughput of kvx.layouts' transforms against memcpy and against straightforward versions.

Every transform moves the same bytes: `--blocks` randomly chosen (unsorted, with gaps) blocks of
each of `--layers` layers out of caches twice that size. Each kvx transform runs twice, on the
native kernel (`kvx.layouts._native`) and on the PyTorch fallback (`KVX_LAYOUTS_NATIVE=0`), and
is timed against

- `copy_`: one plain `Tensor.copy_` of those bytes per layer (contiguous to contiguous), and
- the straightforward torch code a port of vLLM would write (index_select, permute/reshape,
  index_copy_), included below,

all in the same run, interleaved, best of `--repeat`. On a shared machine absolute times are
noise; the ratios are the result.

    python benchmarks/bench_layouts.py            # 32 layers x 128 blocks of 64 KiB: 256 MiB
    python benchmarks/bench_layouts.py --quick    # 4 layers x 32 blocks: 8 MiB
    python benchmarks/bench_layouts.py --threads 1      # torch and the native kernel on 1 core
    python benchmarks/bench_layouts.py --threads 1 --clock cpu  # CPU time: steadier when shared
    python benchmarks/bench_layouts.py --plot out.png   # needs matplotlib (the `bench` extra)
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from rich.console import Console
from rich.table import Table

from kvx.layouts import (
    HND,
    NHD,
    _kernels,
    convert_blocks,
    copy_kv_blocks,
    kv_postprocess_blksize_and_layout_on_receive,
    kv_postprocess_blksize_on_receive,
    kv_postprocess_layout_on_receive,
)

RATIO = 2  # block-size ratio of the block-size transforms
TARGET = "postprocess blksize+layout"  # the transform the issue sets targets for
QUICK_LABEL = "quick (not a result)"  # --quick sizes are too small to judge targets by


Runner = Callable[[], None]


@dataclass
class Case:
    name: str
    kvx: Runner
    straightforward: Runner | None
    note: str


# -- the straightforward versions (what a direct port of vLLM's legacy code does) --------------


def straight_layout(cache: torch.Tensor, idx: torch.Tensor) -> None:
    blocks = cache.index_select(0, idx)
    b, n, h, d = blocks.shape
    cache.index_copy_(0, idx, blocks.reshape(b, h, n, d).permute(0, 2, 1, 3))


def straight_blksize(cache: torch.Tensor, idx: torch.Tensor, r: int) -> None:
    blocks = cache.index_select(0, idx).permute(0, 2, 1, 3)
    b, h, n, d = blocks.shape
    merged = blocks.reshape(b, r, h, n // r, d).permute(0, 2, 1, 3, 4).flatten(2, 3)
    cache.index_copy_(0, idx, merged.permute(0, 2, 1, 3))


def straight_blksize_and_layout(cache: torch.Tensor, idx: torch.Tensor, r: int) -> None:
    blocks = cache.index_select(0, idx)
    b, n, h, d = blocks.shape
    merged = blocks.reshape(b, r, h, n // r, d).permute(0, 1, 3, 2, 4).flatten(1, 2)
    cache.index_copy_(0, idx, merged)


def straight_convert(
    src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor
) -> None:
    """FlashAttention HND `[2, B, n, H, D]` blocks into NHD `[2, B, N, H, D]` blocks, any ratio."""
    kv, _, n_dst, h, d = dst.shape
    tokens = src.index_select(1, src_idx).reshape(kv, -1, h, d)  # token stream, NHD rows
    dst.index_copy_(1, dst_idx, tokens.reshape(kv, -1, n_dst, h, d))


def straight_copy(
    src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor
) -> None:
    dst[:, dst_idx] = src[:, src_idx]  # vLLM's platform swap_out / insert ops


# -- setup --------------------------------------------------------------------------------------


def build(layers: int, blocks: int, block_size: int, heads: int, head_size: int) -> list[Case]:
    dtype = torch.bfloat16
    total = 2 * blocks
    gen = torch.Generator().manual_seed(0)

    def ids(n: int) -> torch.Tensor:
        return torch.randperm(n, generator=gen)[: n // 2]

    def caches(layout, num_blocks: int, size: int) -> list[torch.Tensor]:
        out = []
        for _ in range(layers):
            t = layout.allocate(num_blocks, size, heads, head_size, dtype=dtype)
            t.view(torch.int16).copy_(torch.randint(-(2**15), 2**15, t.shape, generator=gen))
            out.append(t)
        return out

    nhd, hnd = caches(NHD, total, block_size), caches(HND, total, block_size)
    small = caches(HND, RATIO * total, block_size // RATIO)  # remote HND, smaller blocks
    large = caches(NHD, total // RATIO, block_size * RATIO)  # remote NHD, larger blocks
    local = caches(NHD, total, block_size)  # destination of convert and copy
    idx, small_idx, large_idx, local_idx = ids(total), ids(RATIO * total), ids(blocks), ids(total)
    plain_src = [t[:, :blocks].clone() for t in nhd]
    plain_dst = [torch.empty_like(t) for t in plain_src]
    halves = [c[kv] for c in nhd for kv in (0, 1)]  # the per-K/V caches vLLM post-processes
    hnd_halves = [c[kv] for c in hnd for kv in (0, 1)]
    src_map = {f"layer.{i}": t for i, t in enumerate(nhd)}
    dst_map = {f"layer.{i}": t for i, t in enumerate(local)}

    def per(fn: Callable[..., object], tensors: list[torch.Tensor], *args: object) -> Runner:
        def run() -> None:
            for t in tensors:
                fn(t, *args)

        return run

    def pairs(fn: Callable[..., object], srcs: list, dsts: list, *args: object) -> Runner:
        def run() -> None:
            for s, d in zip(srcs, dsts):
                fn(s, d, *args)

        return run

    return [
        Case("copy_ (memcpy)", pairs(torch.Tensor.copy_, plain_dst, plain_src), None, "baseline"),
        Case(
            "postprocess layout",
            per(kv_postprocess_layout_on_receive, halves, idx),
            per(straight_layout, halves, idx),
            "in place, NHD cache, HND bytes",
        ),
        Case(
            "postprocess blksize",
            per(kv_postprocess_blksize_on_receive, hnd_halves, idx, RATIO),
            per(straight_blksize, hnd_halves, idx, RATIO),
            f"in place, HND cache, {RATIO} remote blocks per block",
        ),
        Case(
            TARGET,
            per(kv_postprocess_blksize_and_layout_on_receive, halves, idx, RATIO),
            per(straight_blksize_and_layout, halves, idx, RATIO),
            f"in place, NHD cache, {RATIO} remote HND blocks per block",
        ),
        Case(
            f"convert HND/{block_size // RATIO} -> NHD/{block_size}",
            pairs(partial(convert_blocks, src_layout=HND), small, local, small_idx, idx),
            pairs(straight_convert, small, local, small_idx, idx),
            "remote smaller (vLLM's direction)",
        ),
        Case(
            f"convert NHD/{block_size * RATIO} -> NHD/{block_size}",
            pairs(convert_blocks, large, local, large_idx, idx),
            pairs(straight_convert, large, local, large_idx, idx),
            "remote larger (vLLM rejects it)",
        ),
        Case(
            "copy_kv_blocks d2h",
            lambda: copy_kv_blocks(src_map, dst_map, idx, local_idx, "d2h"),
            pairs(straight_copy, nhd, local, idx, local_idx),
            "whole blocks, cache -> host buffer",
        ),
    ]


def on_torch_path(fn: Runner) -> Runner:
    """`fn` with kvx.layouts' native kernel switched off (as `KVX_LAYOUTS_NATIVE=0` does)."""

    def run() -> None:
        kernel, _kernels.native = _kernels.native, None
        try:
            fn()
        finally:
            _kernels.native = kernel

    return run


def runners(case: Case) -> list[tuple[str, Runner]]:
    """The case's kvx call (native kernel, if built), the same on the PyTorch path, the port."""
    assert case.straightforward is not None
    out = [("torch", on_torch_path(case.kvx)), ("straight", case.straightforward)]
    return ([("kvx", case.kvx)] if _kernels.native is not None else []) + out


Pairs = dict[str, dict[str, list[tuple[float, float]]]]


def measure(cases: list[Case], repeat: int, clock: Callable[[], float]) -> Pairs:
    """For every case and runner, (memcpy seconds, runner seconds) per round.

    Each run is timed right after a memcpy of the same bytes, so the pair shares the machine's
    state of that moment; on a shared machine the median of the pairs' ratios is far steadier
    than a ratio of two independent bests.
    """
    baseline = cases[0].kvx
    pairs: Pairs = {c.name: {} for c in cases[1:]}
    baseline()
    for case in cases[1:]:  # warm up: allocator, page faults, index caches
        for kind, fn in runners(case):
            fn()
            pairs[case.name][kind] = []
    for _ in range(repeat):
        for case in cases[1:]:
            for kind, fn in runners(case):
                start = clock()
                baseline()
                middle = clock()
                fn()
                pairs[case.name][kind].append((middle - start, clock() - middle))
    return pairs


def summary(pairs: list[tuple[float, float]]) -> tuple[float, float]:
    """(best seconds, median of memcpy/runner ratios) of one runner's pairs."""
    return min(t for _, t in pairs), statistics.median(m / t for m, t in pairs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small size (8 MiB), for CI")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--blocks", type=int, default=None, help="blocks moved per layer")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: this thread's CPU time, which time slices lost to other processes do not "
        "inflate (needs --threads 1: other threads' time is not counted)",
    )
    parser.add_argument("--repeat", type=int, default=None, help="timed rounds (best is kept)")
    parser.add_argument("--plot", metavar="PNG", help="write a bar chart (needs matplotlib)")
    args = parser.parse_args()
    layers = args.layers or (4 if args.quick else 32)
    blocks = args.blocks or (32 if args.quick else 128)
    repeat = args.repeat or (20 if args.quick else 9)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu" and torch.get_num_threads() != 1:
        parser.error("--clock cpu needs --threads 1")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter

    console = Console()
    block_bytes = 2 * args.block_size * args.heads * args.head_size * 2
    moved = layers * blocks * block_bytes
    native = "built" if _kernels.native is not None else "NOT BUILT (kvx column = PyTorch path)"
    console.print(
        f"{layers} layers x {blocks} blocks x {block_bytes // 1024} KiB (K+V, {args.block_size} "
        f"tokens, {args.heads} heads, head size {args.head_size}, bf16) = {moved / 2**20:.0f} MiB "
        f"moved per transform; torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"native kernel {native}, {args.clock} clock, best of {repeat}"
    )
    cases = build(layers, blocks, args.block_size, args.heads, args.head_size)
    pairs = measure(cases, repeat, clock)
    memcpy = min(m for kinds in pairs.values() for runs in kinds.values() for m, _ in runs)

    title = "kvx.layouts transforms (ratios: higher is better)"
    table = Table(title=f"{QUICK_LABEL}: {title}" if args.quick else title)
    columns = ("transform", "kvx ms", "GB/s", "x memcpy", "torch-path ms", "x memcpy")
    for col in (*columns, "naive ms", "kvx x naive"):
        table.add_column(col, justify="left" if col == "transform" else "right")
    table.add_row(cases[0].name, f"{memcpy * 1e3:.1f}", f"{moved / memcpy / 1e9:.1f}", "1.00")
    rows = []
    for case in cases[1:]:
        got = {kind: summary(runs) for kind, runs in pairs[case.name].items()}
        t, ratio = got.get("kvx", got["torch"])
        fallback, straight = got.get("torch"), got.get("straight")
        speedup = ratio / straight[1] if straight else None
        rows.append((case.name, ratio, speedup))
        table.add_row(
            case.name,
            f"{t * 1e3:.1f}",
            f"{moved / t / 1e9:.1f}",
            f"{ratio:.2f}",
            f"{fallback[0] * 1e3:.1f}" if fallback else "",
            f"{fallback[1]:.2f}" if fallback else "",
            f"{straight[0] * 1e3:.1f}" if straight else "",
            f"{speedup:.2f}" if speedup else "",
        )
    console.print(table)
    console.print(
        "ms = best run; x memcpy = median over runs of memcpy time / run time, each run paired "
        "with a memcpy just before it; kvx = native kernel when built; torch-path = the same call "
        "with it off (KVX_LAYOUTS_NATIVE=0); naive = the straightforward torch version in this "
        "file; cases:"
    )
    for case in cases:
        console.print(f"  {case.name}: {case.note}")
    target = next(r for r in rows if r[0] == TARGET)
    console.print(
        f"target ({TARGET}): {target[1]:.2f}x memcpy (want >= 0.7), "
        f"{target[2]:.2f}x straightforward (want >= 1.2)"
        + (f" - {QUICK_LABEL}" if args.quick else "")
    )
    if args.plot:
        subtitle = f"{moved / 2**20:.0f} MiB, bf16, {torch.get_num_threads()} threads"
        plot(rows, args.plot, f"{QUICK_LABEL}, {subtitle}" if args.quick else subtitle)
        console.print(f"wrote {args.plot}")


def plot(rows: list[tuple[str, float, float | None]], path: str, subtitle: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'kvx[bench]'") from None
    names = [r[0] for r in rows]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [r[1] for r in rows], 0.4, label="kvx / memcpy")
    ax.bar(
        [i + 0.2 for i in x],
        [r[2] or float("nan") for r in rows],
        0.4,
        label="kvx / straightforward",
    )
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_yscale("log")  # ratios: 0.5x and 2x sit equally far from 1, outliers do not squash
    ax.set_xticks(list(x), names, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("throughput ratio, log scale (higher is better)")
    ax.set_title(f"kvx.layouts transforms ({subtitle})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
