r"""A/B one benchmark between two checkouts of kvx: runs alternate old/new, ratios compared.

Each checkout is a git worktree with its own venvs (`make venv`, `make venv-vllm` in it) and built
native extensions (`setup.py build_ext --inplace`). Runs alternate (old, new, old, new, ...) so
both see the same machine load; each run is a process of its own with torch (OMP) on 1 thread and
COLUMNS=200 (rich tables print one row a line), killed with its process group after `--timeout`.
Every `--ratio NAME=REGEX` is read from each run's output (the regex's first group, a number; the
last match counts) and reported per revision as the median and range over the runs, with whether
the two ranges overlap. Logs of every run are kept in `--out`; `--from-logs` reads the ratios from
them again (say, with a corrected regex).

By default each checkout runs its own copy of the benchmark; `--script-from new` runs the new
checkout's copy against both checkouts' kvx (each venv imports its own tree), for benchmarks
whose script did not change or gained only output; `--new-extra` passes options to the new
checkout's runs only (to switch off a feature the old code did not have).

    python benchmarks/ab_revisions.py --old ../old --new . --runs 5 \
        --ratio 'D CPU ratio=1:1\s*│(?:[^│]*│){5}\s*([\d.]+)' \
        -- bench_nixl.py --repeat 7 --cases 1:1
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path


def run_once(tree: Path, venv: str, script: Path, args: list[str], timeout: float) -> str:
    """One benchmark run in `tree` with `tree`'s venv; its output (stdout, then stderr)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    argv = [str(tree / venv / "bin" / "python"), str(script), *args]
    proc = subprocess.Popen(
        argv,
        cwd=tree,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        text=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return out + f"\n[ab_revisions] killed after {timeout:.0f}s\n"
    if proc.returncode:
        out += f"\n[ab_revisions] exit code {proc.returncode}\n"
    return out


def extract(out: str, ratios: dict[str, re.Pattern[str]]) -> dict[str, float]:
    """The last match of each ratio's regex in `out` (missing ratios are left out)."""
    found = {}
    for name, pattern in ratios.items():
        matches = pattern.findall(out)
        if matches:
            last = matches[-1]
            found[name] = float(last[0] if isinstance(last, tuple) else last)
    return found


def summary(values: dict[str, dict[str, list[float]]], names: list[str]) -> str:
    """Per ratio: median [range] (runs) at each revision and whether the ranges overlap."""
    lines = [
        "| ratio | old: median [range] (runs) | new: median [range] (runs) | overlap |",
        "|---|---|---|---|",
    ]
    for name in names:
        cells, ranges = [], []
        for rev in ("old", "new"):
            got = values[rev][name]
            if got:
                ranges.append((min(got), max(got)))
                cells.append(
                    f"{statistics.median(got):.3f} [{min(got):.3f}-{max(got):.3f}] ({len(got)})"
                )
            else:
                cells.append("no value")
        overlap = (
            ("yes" if ranges[0][0] <= ranges[1][1] and ranges[1][0] <= ranges[0][1] else "NO")
            if len(ranges) == 2
            else "-"
        )
        lines.append(f"| {name} | {cells[0]} | {cells[1]} | {overlap} |")
    return "\n".join(lines)


def named_ratio(text: str) -> tuple[str, re.Pattern[str]]:
    name, sep, regex = text.partition("=")
    if not sep or not name or not regex:
        raise argparse.ArgumentTypeError(f"--ratio {text!r}: expected NAME=REGEX")
    try:
        pattern = re.compile(regex)
    except re.error as exc:
        raise argparse.ArgumentTypeError(f"--ratio {name}: bad regex {regex!r}: {exc}") from exc
    if pattern.groups < 1:
        raise argparse.ArgumentTypeError(f"--ratio {name}: the regex needs a (number) group")
    return name, pattern


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", type=Path, required=True, help="the old checkout")
    parser.add_argument("--new", type=Path, required=True, help="the new checkout")
    parser.add_argument("--runs", type=int, default=5, help="runs per revision (>= 1)")
    parser.add_argument("--venv", default=".venv", help=".venv or .venv-vllm (in each tree)")
    parser.add_argument("--script-from", choices=("own", "new"), default="own")
    parser.add_argument("--ratio", type=named_ratio, action="append", required=True)
    parser.add_argument(
        "--new-extra", default="", help="options only the new run gets (an option it added)"
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--out", type=Path, default=Path("ab-logs"), help="run logs go here")
    parser.add_argument(
        "--from-logs", action="store_true", help="read the ratios from --out's logs, run nothing"
    )
    parser.add_argument("bench", nargs=argparse.REMAINDER, help="-- SCRIPT.py [its options]")
    args = parser.parse_args()
    bench = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    if not bench or not bench[0].endswith(".py"):
        parser.error(f"bench: expected '-- SCRIPT.py [options]', got {bench!r}")
    if args.runs < 1:
        parser.error(f"--runs: {args.runs} is not allowed (at least 1)")
    trees = {"old": args.old.resolve(), "new": args.new.resolve()}
    for rev, tree in trees.items():
        if not (tree / args.venv / "bin" / "python").exists():
            parser.error(f"--{rev}: {tree} has no {args.venv}/bin/python")
    ratios = dict(args.ratio)
    args.out.mkdir(parents=True, exist_ok=True)
    values: dict[str, dict[str, list[float]]] = {r: {n: [] for n in ratios} for r in trees}
    stem = Path(bench[0]).stem
    for i in range(args.runs):
        for rev, tree in trees.items():
            script = (trees["new"] if args.script_from == "new" else tree) / "benchmarks" / bench[0]
            start, load = time.monotonic(), os.getloadavg()[0]
            log = args.out / f"{stem}-{rev}-{i}.log"
            if args.from_logs:
                out = log.read_text() if log.exists() else ""
            else:
                extra = shlex.split(args.new_extra) if rev == "new" else []
                out = run_once(tree, args.venv, script, [*bench[1:], *extra], args.timeout)
                log.write_text(out)
            got = extract(out, ratios)
            for name, value in got.items():
                values[rev][name].append(value)
            print(
                f"{stem} {rev} run {i}: {time.monotonic() - start:.0f}s, load {load:.1f}: "
                + ", ".join(f"{n} {v:.3f}" for n, v in got.items()),
                flush=True,
            )
    print(summary(values, list(ratios)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
