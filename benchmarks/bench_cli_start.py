"""Cold start of `kvx list`, `kvx validate` and `kvx --help`: each run is a fresh interpreter
(the installed `kvx` script); reports the median wall time and the median CPU time (user + sys
of the child, which a shared machine disturbs far less than wall time) over --runs runs.

    .venv/bin/python benchmarks/bench_cli_start.py --runs 7

The tests assert only that these commands do not import torch (tests/core/test_cli_honest.py);
the target here is < 1 s.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

KVX = str(Path(sys.executable).parent / "kvx")
STORE = json.dumps(
    {
        "kv_connector": "SharedStorageConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"storage_url": "file:///tmp/kvx-bench-never-opened"},
    }
)
COMMANDS = {
    "kvx --help": ["--help"],
    "kvx list": ["list"],
    "kvx list --json": ["list", "--json"],
    "kvx validate (storage)": ["validate", "--kv-transfer-config", STORE],
    "kvx validate (nixl)": [
        "validate",
        "--kv-transfer-config",
        '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}',
    ],
}


def one_run(args: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one `kvx ARGS` process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([KVX, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per command (default: 5)")
    args = parser.parse_args()
    env_note = os.environ.get("KVX_BENCH_NOTE", "")
    print(f"{'command':28} {'wall median':>12} {'CPU median':>11}  ({args.runs} runs) {env_note}")
    for name, argv in COMMANDS.items():
        one_run(argv)  # warm the file cache: the cold start measured is the interpreter's
        runs = [one_run(argv) for _ in range(args.runs)]
        wall = statistics.median(r[0] for r in runs)
        cpu = statistics.median(r[1] for r in runs)
        print(f"{name:28} {wall:11.2f}s {cpu:10.2f}s")


if __name__ == "__main__":
    main()
