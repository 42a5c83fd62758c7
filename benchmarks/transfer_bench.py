"""What the P -> D transfer benchmarks (bench_nixl.py, bench_p2p.py) share: the KV shape of a
run, the options every one of them takes, the label of a --quick run and waiting for the
prefill process."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

QUICK_LABEL = "quick (not a result)"  # --quick sizes are too small to judge targets by


@dataclass(frozen=True)
class Shape:
    """`requests` prompts of `tokens` tokens each, over `layers` layers of 2-byte K and V."""

    layers: int
    heads: int
    head_size: int
    block_size: int
    requests: int
    tokens: int

    @property
    def blocks_per_request(self) -> int:
        return -(-self.tokens // self.block_size)

    @property
    def num_blocks(self) -> int:
        """Blocks of a KV cache that holds every request, plus a few spare."""
        return self.requests * self.blocks_per_request + 8

    @property
    def slice_bytes(self) -> int:
        """One request's K and V of one layer."""
        return 2 * self.blocks_per_request * self.block_size * self.heads * self.head_size * 2

    @property
    def nbytes(self) -> int:
        """What one round moves."""
        return self.slice_bytes * self.layers * self.requests


def bench_options(doc: str, quick_size: str, kept: str) -> argparse.ArgumentParser:
    """The options of every transfer benchmark: --quick (`quick_size`, for CI), --repeat (the
    `kept` round is reported: "best" or "median") and --plot."""
    options = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    options.add_argument("--quick", action="store_true", help=f"{quick_size}, for CI")
    options.add_argument("--repeat", type=int, default=5, help=f"timed rounds ({kept} is kept)")
    options.add_argument("--plot", metavar="PNG", help="write a bar chart (needs matplotlib)")
    return options


def titled(title: str, quick: bool) -> str:
    """`title`, labelled as no result for a --quick run."""
    return f"{QUICK_LABEL}: {title}" if quick else title


def receive(conn: Connection, proc: Any, timeout_s: float = 300.0) -> Any:
    """The prefill process's next message; fails (never hangs) if it died or went silent."""
    deadline = time.monotonic() + timeout_s
    while not conn.poll(0.2):
        if not proc.is_alive():
            raise RuntimeError(f"the prefill process exited with {proc.exitcode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the prefill process sent nothing for {timeout_s:.0f}s")
    return conn.recv()
