"""The `s3://` backend against its own raw client (s3fs) on the same bytes, on SeaweedFS.

`--values` values of `--mib` MiB per batch are saved (`put_vectored`, each value two
buffers) and loaded (`get_vectored` into buffers) by the backend, and put (`pipe_file`) and
read (`cat_file`, then copied into the same buffers) by s3fs directly. Every variant runs in
each round, interleaved; medians over `--rounds` of wall time and this process's CPU time
(`time.process_time`; the server's excluded), with the raw/kvx ratios per round. The server
is the tests' `SeaweedS3` (one `weed server` on loopback); loaded bytes are checked. On a
shared machine absolute times are noise, the ratios are the result.

    python benchmarks/bench_s3.py             # 8 values x 2 MiB, 9 rounds
    python benchmarks/bench_s3.py --quick
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))  # the tests' real-server fixtures

import s3fs  # noqa: E402
from kvx_seaweed import S3_ACCESS_KEY, S3_SECRET_KEY, SeaweedS3  # noqa: E402

import kvx  # noqa: E402
from kvx.plugins.storage.backends.base import BackendOptions, copy_into  # noqa: E402

Step = Callable[[str], None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--values", type=int, default=8)
    parser.add_argument("--mib", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.values, args.mib, args.rounds = 4, 1, min(args.rounds, 3)
    os.environ["AWS_ACCESS_KEY_ID"] = S3_ACCESS_KEY
    os.environ["AWS_SECRET_ACCESS_KEY"] = S3_SECRET_KEY
    size = args.mib << 20
    values = [os.urandom(size) for _ in range(args.values)]
    outs = [
        [memoryview(bytearray(size // 2)), memoryview(bytearray(size - size // 2))] for _ in values
    ]
    with SeaweedS3() as server:
        root = f"{server.bucket}/bench-{uuid.uuid4().hex[:8]}"
        backend = kvx.open_storage_backend(
            f"s3://{root}/kvx", BackendOptions(storage_options=server.storage_options())
        )
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options())  # type: ignore[arg-type]

        # each value as two views, as the connector hands the backend views of the KV cache
        # (slicing the bytes inside the timed step copied each value twice more for kvx only)
        halves = [[memoryview(v)[: size // 2], memoryview(v)[size // 2 :]] for v in values]

        def kvx_put(tag: str) -> None:
            backend.put_vectored([(f"{tag}/v{i}", parts) for i, parts in enumerate(halves)])

        def kvx_get(tag: str) -> None:
            sizes = backend.get_vectored([f"{tag}/v{i}" for i in range(len(values))], outs)
            assert sizes == [size] * len(values)

        def raw_put(tag: str) -> None:
            for i, v in enumerate(values):
                fs.pipe_file(f"{root}/raw/{tag}/v{i}", v)

        def raw_get(tag: str) -> None:
            for i in range(len(values)):
                copy_into(outs[i], fs.cat_file(f"{root}/raw/{tag}/v{i}"))

        steps: dict[tuple[str, str], Step] = {
            ("kvx s3://", "put"): kvx_put,
            ("kvx s3://", "get"): kvx_get,
            ("s3fs", "put"): raw_put,
            ("s3fs", "get"): raw_get,
        }
        runs: dict[tuple[str, str], list[tuple[float, float]]] = {k: [] for k in steps}
        for r in range(args.rounds + 1):  # round 0 warms up
            for (name, op), step in steps.items():
                for out in outs:
                    for part in out:
                        part[:] = bytes(part.nbytes)
                wall, cpu = time.perf_counter(), time.process_time()
                step(f"r{r}")
                took = (time.perf_counter() - wall, time.process_time() - cpu)
                if op == "get":
                    assert all(
                        bytes(o[0]) + bytes(o[1]) == v for o, v in zip(outs, values, strict=True)
                    )
                if r:
                    runs[(name, op)].append(took)
        backend.close()
    nbytes = args.values * size
    label = "quick (not a result): " if args.quick else ""
    print(
        f"{label}{args.values} values x {args.mib} MiB per batch; medians of {args.rounds} rounds"
    )
    print("| variant | op | wall ms | CPU ms | MB/s (wall) | raw/kvx CPU | raw/kvx wall |")
    print("|---|---|---|---|---|---|---|")
    for (name, op), timings in runs.items():
        wall = statistics.median(t[0] for t in timings)
        cpu = statistics.median(t[1] for t in timings)
        ratios = ["", ""]
        if name.startswith("kvx"):
            base = runs[("s3fs", op)]
            ratios = [
                f"{statistics.median(b[k] / t[k] for b, t in zip(base, timings, strict=True)):.2f}"
                for k in (1, 0)
            ]
        print(
            f"| {name} | {op} | {wall * 1e3:.1f} | {cpu * 1e3:.1f} | {nbytes / wall / 1e6:.0f} | "
            f"{ratios[0]} | {ratios[1]} |"
        )


if __name__ == "__main__":
    main()
