"""vLLM's own MultiConnector, in vLLM's documented form (every child a whole
`--kv-transfer-config` with its own `kv_role`), composing kvx connectors online: a file store
first, then NIXL, on P and on D behind `kvx proxy`. D loads prompts of 129+ tokens from the
store and shorter ones over NIXL; the tokens equal one engine's.

The children name kvx connectors both ways vLLM resolves a child: through kvx's vLLM plugin
(`kvx.SharedStorageConnector`, no module path) and through the adapter module
(`NixlConnector` + `kv_connector_module_path`). vLLM special-cases the top-level name
`MultiConnector` (its own class, whose children must each carry `kv_role` and a name vLLM can
resolve); kvx's own MultiConnector is not reachable under that name inside vLLM, see
docs/serving.md.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import serving_kit as kit
from serving_client import Request

pytestmark = pytest.mark.timeout(900)

BLOCK = 128


def multi_json(role: str, store: Path) -> dict[str, Any]:
    return {
        "kv_connector": "MultiConnector",
        "kv_role": role,
        "kv_connector_extra_config": {
            "connectors": [
                {
                    "kv_connector": "NixlConnector",
                    "kv_connector_module_path": "kvx.adapters.vllm",
                    "kv_role": role,
                    "kv_connector_extra_config": {"required_layout": None},
                },
                {
                    "kv_connector": "kvx.SharedStorageConnector",
                    "kv_role": role,
                    "kv_connector_extra_config": {"storage_url": f"file://{store}"},
                },
            ]
        },
    }


@pytest.fixture(scope="module")
def multi(fleet: kit.Fleet, long_tiny_model: Path) -> Iterator[kit.Deployment]:
    store = fleet.log_dir / "kv-store"
    yield kit.deploy(
        fleet,
        long_tiny_model,
        [multi_json("kv_producer", store)],
        [multi_json("kv_consumer", store)],
    )


def test_vllm_multiconnector_of_kvx_children_serves_one_engines_tokens(
    multi: kit.Deployment, workload: list[Request], reference: list[list[int]]
) -> None:
    kit.serve_rounds(multi, workload, reference)

    def nixl_reads() -> None:  # MultiConnector logs {child class name: child stats}
        log = multi.decodes[0].log.read_text(errors="replace")
        reads = re.findall(r"kvx\.NixlConnector=\{'Num successful transfers': (\d+)", log)
        assert sum(map(int, reads)) > 0, "D's log shows no NIXL READs"
        assert not re.search(r"'Num failed transfers': [1-9]", log), "D's NIXL READs failed"

    kit.eventually(nixl_reads)
