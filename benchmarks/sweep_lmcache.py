"""LMCache's local CPU and local disk tiers as peers in the storage shape sweep.

`bench_storage_sweep.py` runs in `.venv`, which has no LMCache: per shape this runs
`peer_lmcache.py` in `.venv-vllm` (a subprocess), where LMCache local CPU, kvx's
OffloadingConnector, LMCache local disk and kvx `file://` move the shape's bytes in
interleaved rounds of one process, so each ratio is paired per round. `table` reports them.
"""

from __future__ import annotations

import json
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

from measured_run import run_measured

VLLM_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
PAIRS = (  # (kvx case, LMCache peer, target)
    ("kvx offload CPU", "LMCache local CPU", 1.5),
    ("kvx file://", "LMCache local disk", 2.0),
)


@cache
def lmcache_installed() -> bool:
    """Whether .venv-vllm exists and imports LMCache."""
    if not VLLM_PYTHON.exists():
        return False
    argv = [str(VLLM_PYTHON), "-c", "import lmcache"]
    return subprocess.run(argv, capture_output=True, timeout=300, check=False).returncode == 0


def run(shape_argv: list[str], where: str | None) -> tuple[dict[str, Any] | None, int | None]:
    """The peers' times on a shape (`peer_lmcache.py`'s shape arguments) and the process's
    peak RSS in bytes (None, None without LMCache in .venv-vllm)."""
    if not lmcache_installed():
        return None, None
    script = Path(__file__).resolve().parent / "peer_lmcache.py"
    argv = [str(VLLM_PYTHON), str(script), *shape_argv]
    if where is not None:
        argv += ["--dir", where]
    done = run_measured(argv, 3600.0)
    if done.returncode or done.timed_out:
        raise SystemExit(f"LMCache peer run failed:\n{done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result, done.peak_rss


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _cell(times: dict[str, dict[str, list[float]]], ours: str, peer: str, kind: str) -> str:
    ratios = [p / o for p, o in zip(times[peer][kind], times[ours][kind], strict=True)]
    return f"**{_median(ratios):.2f}** ({min(ratios):.2f}-{max(ratios):.2f})"


def table(rows: list[tuple[str, dict[str, Any] | None]]) -> str:
    """Per shape label and peer result: CPU ms and per-round ratios (peer time / kvx time, > 1:
    kvx is cheaper), medians with their range, and the wall-time medians."""
    lines = [
        "| shape | load avg | LMCache CPU / kvx offload save+load CPU ms | offload vs "
        "LMCache CPU save (CPU) | load (CPU) | LMCache disk / kvx file:// save+load CPU ms | "
        "file:// vs LMCache disk save (CPU) | load (CPU) | wall: offload save/load, "
        "file:// save/load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, peer in rows:
        if peer is None:
            lines.append(f"| {label} | - | no .venv-vllm | | | | | | |")
            continue
        t = peer["times"]

        def ms(case: str, t: dict[str, dict[str, list[float]]] = t) -> str:
            return "/".join(f"{_median(t[case][k]) * 1e3:.1f}" for k in ("save", "load"))

        cells, walls = [], []
        for ours, theirs, _ in PAIRS:
            cells.append(f"{ms(theirs)} vs {ms(ours)}")
            cells += [_cell(t, ours, theirs, k) for k in ("save", "load")]
            walls += [
                f"{_median([p / o for p, o in zip(t[theirs][k], t[ours][k], strict=True)]):.2f}"
                for k in ("save wall", "load wall")
            ]
        load = peer["load"]
        lines.append(
            f"| {label} | {load[0]:.1f}-{load[1]:.1f} | {' | '.join(cells)} | "
            f"{'/'.join(walls[:2])}, {'/'.join(walls[2:])} |"
        )
    return "\n".join(lines)
