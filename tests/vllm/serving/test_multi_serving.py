"""vLLM's own MultiConnector, in vLLM's documented form (every child a whole
`--kv-transfer-config` with its own `kv_role`), composing kvx connectors online behind `kvx
proxy`: a file store and NIXL in push mode (`NixlPushConnector`: P WRITEs into the blocks D
registered), NIXL first on P and the store first on D, so both orders run. D loads every whole
block the store holds from the store and the rest through P's NIXL WRITEs; the tokens equal one
engine's, D's logged stats of each child and vLLM's own count of the tokens D loaded from
outside prove its loads, and both servers free every KV block once the run is over (each kvx
child's report guard used to drop its sibling's reports: P then never freed the blocks NIXL had
sent). NIXL pull mode is served by test_fleet_serving.py, and is a MultiConnector child inside
vLLM in tests/vllm/test_multi_in_vllm.py.

This is also the online P/D test of the file store (the store-first D loads each prompt's whole
blocks from it); redis is the cross-host test's store.

The children name kvx connectors both ways vLLM resolves a child: through kvx's vLLM plugin
(`kvx.SharedStorageConnector`, no module path) and through the adapter module
(`NixlPushConnector` + `kv_connector_module_path`). vLLM special-cases the top-level name
`MultiConnector` (its own class, whose children must each carry `kv_role` and a name vLLM can
resolve); kvx's own MultiConnector is not reachable under that name inside vLLM, see
docs/serving.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import serving_checks as checks
import serving_kit as kit
from serving_client import Request

pytestmark = pytest.mark.timeout(900)


def multi_json(role: str, store: Path, store_first: bool) -> dict[str, Any]:
    nixl = {
        "kv_connector": "NixlPushConnector",
        "kv_connector_module_path": "kvx.adapters.vllm",
        "kv_role": role,
        "kv_connector_extra_config": {"required_layout": None},
    }
    file_store = {
        "kv_connector": "kvx.SharedStorageConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"storage_url": f"file://{store}"},
    }
    children = [file_store, nixl] if store_first else [nixl, file_store]
    return {
        "kv_connector": "MultiConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"connectors": children},
    }


@pytest.fixture(scope="module")
def multi(fleet: kit.Fleet, long_tiny_model: Path) -> Iterator[kit.Deployment]:
    store = fleet.log_dir / "kv-store"
    yield kit.deploy(
        fleet,
        long_tiny_model,
        [multi_json("kv_producer", store, store_first=False)],
        [multi_json("kv_consumer", store, store_first=True)],
    )


def test_vllm_multiconnector_of_kvx_children_serves_one_engines_tokens(
    multi: kit.Deployment, workload: list[Request], reference: list[list[int]]
) -> None:
    kit.serve_rounds(multi, workload, reference)
    p, d = multi.prefills[0], multi.decodes[0]
    # what the store cannot serve (no whole block before the last token) D reads over NIXL
    short = [r for r in checks.unshared(workload) if checks.store_loadable(len(r.prompt)) == 0]

    def d_loaded() -> None:  # MultiConnector logs {child class name: child stats}
        children = checks.logged_child_stats(d)
        store = children.get("SharedStorageConnector", {})
        checks.check_store_loads(store, workload)
        # push: P records the WRITEs, D none; D's loads are what vLLM counts beyond the store's
        checks.check_nixl_reads(checks.logged_child_stats(p).get("NixlPushConnector", {}), short)
        assert children.get("NixlPushConnector", {}).get("Num failed transfers", 0) == 0
        pushed = checks.external_tokens(d) - store.get("loaded_tokens", 0)
        assert pushed >= sum(len(r.prompt) - 1 for r in short) > 0, (pushed, children)

    kit.eventually(d_loaded)
    for server in (p, d):
        kit.eventually(lambda server=server: checks.check_all_blocks_freed(server), 40)
        checks.check_no_stray_reports(server)
