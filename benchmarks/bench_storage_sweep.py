"""`file://` saves and loads against a plain file per layer, over a sweep of shapes.

Each shape (layers x block size x bytes x request mix) builds its own KV caches (NHD, 8 KV
heads, head size 128, bfloat16, blocks scattered over a cache twice the size) and runs, in
interleaved rounds on the same bytes:

- `kvx file://`: SharedStorageConnector on a temporary directory (worker side, as
  `bench_storage.py` drives it), values batched into segment files (the default);
- `kvx per-value files`: the same connector writing one file per value, as block-format-3
  stores did before segment files (reads are the same);
- `raw file`: one plain file per layer, written from / read into one contiguous tensor;
- `kvx offload CPU`: the OffloadingConnector's CPU tier storing every block into CPU slots
  and loading them back, against `copy_ (memcpy)`: one `Tensor.copy_` of the same bytes per
  layer (both take milliseconds: 5 timed calls per round).

By default everything runs on one thread (`torch.set_num_threads(1)`, `io_threads: 1`) and the
ratios are taken on CPU time (this process, all threads): on a machine shared with other jobs
those repeat, where wall times follow the load. Each figure is the median of `--repeat`
rounds (range beside it); the load average is recorded before and after each shape.

Memory: each shape's kvx cases run in a process of their own (its memory is returned before the
next shape), then the peers', one after the other; every process's peak RSS is reported. The
destination blocks are the other half of the source caches (one cache per layer, twice the KV
bytes) and loaded bytes are compared a few MiB at a time: the kvx process peaks at about 5x the
KV bytes (caches 2x, the raw file's and memcpy's contiguous copies 2x, the CPU tier's slots 1x)
plus the interpreter. Stored files are deleted just before each case's next save, as before:
deleting them right after the load (to hold less page cache) made the raw file's saves 1.4-10x
dearer in some rounds (32L b16 and 8L b128 at 256 MiB, two A/B runs).

    python benchmarks/bench_storage_sweep.py --quick     # 8 and 32 layers, 16-token blocks, 8 MiB
    python benchmarks/bench_storage_sweep.py             # 8/32/80 layers x 16/128 tokens x sizes
    nice python benchmarks/bench_storage_sweep.py --huge --only 1024MiB   # 1 GiB, alone
    python benchmarks/bench_storage_sweep.py --shape 32,16,256,long     # one shape
    python benchmarks/bench_storage_sweep.py --plot sweep.png
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from statistics import median
from typing import Any

import torch

from kvx.plugins.storage.backends import local_files

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sweep_lmcache
from measured_run import Finished, run_measured
from storage_baselines import KV, Case, Memcpy, RawFiles, drop_files, make_kv, measure_rounds
from storage_cases import OffloadCase, StorageCase

TOKEN_BYTES = 2 * 8 * 128 * 2  # K+V, 8 heads, head size 128, bf16: per token and layer
MIB = 1 << 20


@dataclass(frozen=True)
class Shape:
    layers: int
    block_size: int
    mib: int
    mix: str  # "short": requests of 2 blocks; "long": one request

    def requests_tokens(self) -> tuple[int, int]:
        """The batch: how many requests, of how many tokens each."""
        block_bytes = self.layers * self.block_size * TOKEN_BYTES
        blocks = max(2, self.mib * MIB // block_bytes)
        requests = blocks // 2 if self.mix == "short" else 1
        return requests, (blocks // requests) * self.block_size

    def kv(self) -> KV:
        requests, tokens = self.requests_tokens()
        return make_kv(self.layers, requests, tokens, 8, 128, self.block_size, one_cache=True)

    def peer_argv(self, repeat: int, threads: int) -> list[str]:
        """The shape as the peer scripts (peer_*.py) take it."""
        requests, tokens = self.requests_tokens()
        return [
            *("--layers", str(self.layers), "--block-size", str(self.block_size)),
            *("--requests", str(requests), "--tokens", str(tokens)),
            *("--repeat", str(repeat), "--threads", str(threads)),
        ]

    @property
    def label(self) -> str:
        return f"{self.layers}L b{self.block_size} {self.mib}MiB {self.mix}"

    @classmethod
    def parse(cls, text: str) -> Shape:
        """`LAYERS,BLOCK,MIB,MIX` (`--shape`), e.g. `32,16,256,long`."""
        parts = text.split(",")
        numbers = len(parts) == 4 and all(p.isdigit() and int(p) > 0 for p in parts[:3])
        if numbers and parts[3] in ("short", "long"):
            return cls(int(parts[0]), int(parts[1]), int(parts[2]), parts[3])
        raise argparse.ArgumentTypeError(
            f"{text!r}: want LAYERS,BLOCK,MIB,MIX with three positive integers and MIX short "
            "or long, e.g. 32,16,256,long"
        )


HUGE = tuple(Shape(layers, block, 1024, "short") for layers in (8, 32, 80) for block in (16, 128))
"""1 GiB of KV: the kvx process peaked at 5.1-5.5 GiB, the ExampleConnector's at 2.6 GiB and the
LMCache peers' at 6-9 GiB (one after the other): only with --huge, alone, with ~10 GiB free
(~6 GiB with --no-lmcache); ~3-6 minutes a shape."""


def shapes(quick: bool, huge: bool = False) -> Iterator[Shape]:
    if quick:
        yield from (Shape(8, 16, 8, "short"), Shape(32, 16, 8, "long"))
        return
    for layers in (8, 32, 80):
        for block_size in (16, 128):
            for mib in (8, 64, 256):
                yield Shape(layers, block_size, mib, "short")
        yield Shape(layers, 16, 64, "long")
    if huge:
        yield from HUGE


def per_value_files(case: StorageCase) -> None:
    """Make the producer's backend write one file per value (the layout before segments)."""
    backend: Any = case.producer.worker.backend  # type: ignore[attr-defined]
    native: Any = local_files._fileio

    def write(paths: list[str], keys: list[str], seeds: list[bytes], prefix: bytes,
              regions: Any, blocks: list[int]) -> list[int]:  # fmt: skip
        tmps = [f"{p}.tmp-{backend._tmp_tag}-{next(backend._tmp_serial)}" for p in paths]
        return list(native.write_blocks(paths, tmps, seeds, prefix, regions, blocks))

    backend._write_hashed = write


def run_shape(
    shape: Shape, repeat: int, threads: int, root: Path, offload: bool = True, verify: bool = True
) -> dict[str, Any]:
    """kvx's cases and their baselines on one shape, in this process (the `--child` run)."""
    kv = shape.kv()
    extra: dict[str, Any] = {"io_threads": threads, "verify_checksums": verify}
    seg = StorageCase(kv, f"file://{root}/seg", partial(drop_files, root / "seg"), **extra)  # type: ignore[arg-type]
    one = StorageCase(kv, f"file://{root}/one", partial(drop_files, root / "one"), **extra)  # type: ignore[arg-type]
    per_value_files(one)
    raw = RawFiles(kv, root / "raw")
    cases = [
        Case("raw file", raw.save, raw.load, None, "", fresh=raw.fresh),
        Case("kvx file://", seg.save, seg.load, "raw file", "", seg.fresh, seg.plan_load),
        Case("kvx per-value files", one.save, one.load, "raw file", "", one.fresh, one.plan_load),
    ]
    tier = OffloadCase(kv) if offload else None
    if tier is not None:
        memcpy = Memcpy(kv, raw.data, raw.back)  # the raw file's tensors: no more memory
        cases.append(Case("copy_ (memcpy)", memcpy.save, memcpy.load, None, "", inner=5))
        cases.append(Case("kvx offload CPU", tier.save, tier.load, "copy_ (memcpy)", "", inner=5))
    load_before = os.getloadavg()[0]
    try:
        results = measure_rounds(cases, repeat)
        kv.clear_dst()
        seg.fresh(), seg.save(), seg.plan_load(), seg.load()
        kv.check(kv.dst, kv.all_dst, "kvx file://")
        if tier is not None:
            tier.check()  # every block loaded back from the CPU tier, compared
    finally:
        for case in (seg, one, *([tier] if tier else [])):
            case.close()
        shutil.rmtree(root / "raw", ignore_errors=True)
    return {"bytes": kv.nbytes, "load": (load_before, os.getloadavg()[0]), "results": results}


VLLM_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
CHILD_TIMEOUT_S = 3600.0


def last_json(done: Finished, what: str) -> Any:
    """The JSON object a child printed last; a clear exit when it failed."""
    if done.returncode or done.timed_out:
        why = f"timed out after {CHILD_TIMEOUT_S:.0f} s" if done.timed_out else "failed"
        code = f"exit {done.returncode}"
        if done.returncode < 0:  # a signal: the OOM killer's SIGKILL, for one
            code += ", killed: see `dmesg -T | tail`"
        raise SystemExit(f"{what} {why} ({code}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def kvx_cases(shape: Shape, args: argparse.Namespace, tmp: str) -> tuple[dict[str, Any], int]:
    """`run_shape` in a process of its own; its row and peak RSS."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", str(tmp)]
    argv += ["--shape", f"{shape.layers},{shape.block_size},{shape.mib},{shape.mix}"]
    argv += ["--repeat", str(args.repeat), "--threads", str(args.threads)]
    argv += ["--no-offload"] * args.no_offload + ["--no-verify"] * args.no_verify
    done = run_measured(argv, CHILD_TIMEOUT_S)
    row: dict[str, Any] = last_json(done, f"the kvx cases of {shape.label}")
    return row, done.peak_rss


def example_connector(shape: Shape, repeat: int, threads: int) -> tuple[Any, int | None]:
    """vLLM's real ExampleConnector on the same shape, in .venv-vllm, and its peak RSS (None,
    None without it)."""
    if not VLLM_PYTHON.exists():
        return None, None
    script = Path(__file__).resolve().parent / "peer_example_connector.py"
    done = run_measured([str(VLLM_PYTHON), str(script), *shape.peer_argv(repeat, threads)],
                        CHILD_TIMEOUT_S)  # fmt: skip
    return last_json(done, "ExampleConnector run"), done.peak_rss


def ratios(
    times: dict[str, dict[str, list[float]]], case: str, kind: str, base: str = "raw file"
) -> list[float]:
    """Per round, `base` time / case time (> 1: the case is faster)."""
    return [r / c for r, c in zip(times[base][kind], times[case][kind], strict=True)]


def report(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| shape | MiB | load avg | raw save / load CPU ms | kvx save / load CPU ms | "
        "kvx vs raw save (CPU) | kvx vs raw load (CPU) | per-value files vs raw save (CPU) | "
        "kvx vs raw save / load (wall) | kvx vs vLLM ExampleConnector save / load (CPU) | "
        "offload vs memcpy save (CPU) | offload vs memcpy load (CPU) |",
        "|---|---:|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        t = row["results"]

        def cell(
            case: str, kind: str, t: dict[str, dict[str, list[float]]] = t, base: str = "raw file"
        ) -> str:
            if case not in t:
                return "-"
            r = ratios(t, case, kind, base)
            return f"**{median(r):.2f}** ({min(r):.2f}-{max(r):.2f})"

        tier = [
            cell("kvx offload CPU", f"{k} cpu", base="copy_ (memcpy)") for k in ("save", "load")
        ]

        ms = {c: "/".join(f"{median(t[c][k]) * 1e3:.1f}" for k in ("save cpu", "load cpu"))
              for c in t}  # fmt: skip
        wall = "/".join(f"{median(ratios(t, 'kvx file://', k)):.2f}" for k in ("save", "load"))
        lines.append(
            f"| {row['shape'].label} | {row['bytes'] / MIB:.0f} | "
            f"{row['load'][0]:.1f}-{row['load'][1]:.1f} | {ms['raw file']} | {ms['kvx file://']} | "
            f"{cell('kvx file://', 'save cpu')} | {cell('kvx file://', 'load cpu')} | "
            f"{cell('kvx per-value files', 'save cpu')} | {wall} | {peer_cell(row)} | "
            f"{tier[0]} | {tier[1]} |"
        )
    return "\n".join(lines)


def rss_table(rows: list[dict[str, Any]]) -> str:
    """Per shape, the peak RSS of the kvx process and of the peers' ("-": not run)."""
    lines = ["| shape | KV MiB | kvx cases | vLLM ExampleConnector | LMCache peers |",
             "|---|---:|---:|---:|---:|"]  # fmt: skip
    for row in rows:
        rss = [row["rss"].get(k) for k in ("kvx", "ExampleConnector", "LMCache")]
        cells = " | ".join("-" if b is None else f"{b / MIB:.0f}" for b in rss)
        lines.append(f"| {row['shape'].label} | {row['bytes'] / MIB:.0f} | {cells} |")
    return "\n".join(lines)


def peer_cell(row: dict[str, Any]) -> str:
    """ExampleConnector's median CPU time / kvx's, save / load ("-" without .venv-vllm)."""
    peer, t = row["peer"], row["results"]["kvx file://"]
    if peer is None:
        return "-"
    save = median(peer["save"]) / median(t["save cpu"])
    load = median(peer["load"]) / median(t["load cpu"])
    return f"**{save:.2f} / {load:.2f}**"


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """Bar charts of the medians: `path` for file:// against the raw file and, when the CPU
    tier ran, `<path stem>-offload.png` for it against memcpy."""
    file_series = [
        ("kvx save", "kvx file://", "save cpu", "raw file"),
        ("kvx load", "kvx file://", "load cpu", "raw file"),
        ("per-value files save", "kvx per-value files", "save cpu", "raw file"),
    ]
    _bars(rows, file_series, "x raw file", "file:// vs one plain file per layer", path)
    if all("kvx offload CPU" in row["results"] for row in rows):
        tier_series = [
            ("offload save", "kvx offload CPU", "save cpu", "copy_ (memcpy)"),
            ("offload load", "kvx offload CPU", "load cpu", "copy_ (memcpy)"),
        ]
        stem = path.removesuffix(".png")
        _bars(
            rows,
            tier_series,
            "x memcpy",
            "OffloadingConnector CPU tier vs memcpy",
            f"{stem}-offload.png",
        )


def _bars(
    rows: list[dict[str, Any]], series: list[tuple[str, str, str, str]], unit: str, title: str,
    path: str,
) -> None:  # fmt: skip
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [row["shape"].label for row in rows]
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.7), 4.5))
    width = 0.8 / len(series)
    for k, (name, case, kind, base) in enumerate(series):
        values = [median(ratios(row["results"], case, kind, base)) for row in rows]
        ax.bar([i + k * width for i in range(len(rows))], values, width, label=name)
    ax.axhline(0.8, color="red", linestyle="--", linewidth=1, label="target 0.8x")
    ax.set_xticks([i + width for i in range(len(rows))], labels, rotation=60, ha="right")
    ax.set_ylabel(f"{unit} (CPU time, 1 thread; higher is faster)")
    ax.set_title(f"{title}, medians")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def measure_shapes(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """Per shape selected by `args`: the kvx cases' row, then the peers', one process at a time."""
    for shape in args.shape or shapes(args.quick, args.huge):
        if (args.only and args.only not in shape.label) or shape.mib > (args.max_mib or shape.mib):
            continue
        with tempfile.TemporaryDirectory(prefix="kvx-sweep-", dir=args.dir) as tmp:
            row, rss = kvx_cases(shape, args, tmp)
            row.update(shape=shape, peer=None, lmcache=None, rss={"kvx": rss})
            if not args.no_peers:
                row["peer"], row["rss"]["ExampleConnector"] = example_connector(
                    shape, args.repeat, args.threads
                )
            if not (args.no_peers or args.no_lmcache):
                row["lmcache"], row["rss"]["LMCache"] = sweep_lmcache.run(
                    shape.peer_argv(args.repeat, args.threads), tmp
                )
        yield row


def dump_row(row: dict[str, Any]) -> str:
    shape: Shape = row["shape"]
    return json.dumps({**row, "shape": [shape.layers, shape.block_size, shape.mib, shape.mix]})


def load_row(line: str) -> dict[str, Any]:
    row: dict[str, Any] = json.loads(line)
    row["shape"] = Shape(*row["shape"])
    return row


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="two small shapes, for CI")
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds per shape (median)")
    parser.add_argument("--threads", type=int, default=1, help="torch and IO threads")
    parser.add_argument("--dir", default=None, help="where the files go (default: the tmp dir)")
    parser.add_argument("--only", default=None, help="shapes whose label contains this")
    parser.add_argument("--max-mib", type=int, default=None, help="skip larger shapes")
    parser.add_argument(
        "--no-peers", action="store_true",
        help="skip vLLM's ExampleConnector and LMCache (peer_*.py, run in .venv-vllm)",
    )  # fmt: skip
    parser.add_argument("--no-offload", action="store_true", help="skip the CPU tier and memcpy")
    parser.add_argument(
        "--huge", action="store_true", help="add the 1 GiB shapes (run them alone, nice'd)"
    )
    parser.add_argument("--plot", metavar="PNG", help="write a bar chart (needs matplotlib)")
    parser.add_argument(
        "--no-verify", action="store_true",
        help="kvx loads with verify_checksums false (length and header checks only)",
    )  # fmt: skip
    parser.add_argument("--no-lmcache", action="store_true", help="skip the LMCache peers")
    parser.add_argument("--child", metavar="DIR", help=argparse.SUPPRESS)  # one shape's kvx run
    parser.add_argument(
        "--shape", type=Shape.parse, action="append", metavar="LAYERS,BLOCK,MIB,MIX",
        help="run this shape (repeatable) instead of the sweep's, e.g. 32,16,256,long",
    )  # fmt: skip
    parser.add_argument(
        "--json", metavar="FILE", help="append each shape's row to FILE (JSON lines)"
    )
    parser.add_argument(
        "--from-json", metavar="FILE", action="append",
        help="measure nothing: report (and --plot) the rows of these --json files, merged",
    )  # fmt: skip
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.child:
        row = run_shape(args.shape[0], args.repeat, args.threads, Path(args.child),
                        not args.no_offload, not args.no_verify)  # fmt: skip
        print(json.dumps(row))
        return [row]
    if args.from_json:
        rows = [load_row(line) for f in args.from_json for line in Path(f).read_text().splitlines()]
        print(f"rows of {', '.join(args.from_json)}; ratios: raw / kvx time")
    else:
        rows = []
        for row in measure_shapes(args):
            rows.append(row)
            print(report(rows[-1:]).splitlines()[-1], flush=True)
            if args.json:
                with open(args.json, "a") as out:
                    out.write(dump_row(row) + "\n")
        rounds = f"{args.threads} thread(s), medians of {args.repeat} rounds"
        print(f"\n{rounds}; ratios: raw / kvx time")
    print(report(rows))
    if any(row["lmcache"] for row in rows):
        print("\nLMCache peers (paired per round in one .venv-vllm process; peer / kvx time)")
        print(sweep_lmcache.table([(row["shape"].label, row["lmcache"]) for row in rows]))
    print("\nPeak RSS per process, MiB (each shape's processes run one after the other)")
    print(rss_table(rows))
    if args.plot:
        plot(rows, args.plot)
    return rows


if __name__ == "__main__":
    main()
