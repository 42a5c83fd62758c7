"""Online prefill/decode through `vllm serve` and `kvx proxy` with each built-in kvx connector: 40
requests (prompts of 1 to 1,500 tokens, shared prefixes, streamed and not, idle gaps between
bursts) all complete with exactly one plain engine's tokens, and D proves it loaded the KV: D's
logged kvx stats count the loads (NIXL: at least one successful READ per prompt that shares no
prefix, none failed; stores: every loadable token), and for the stores each response's cached
prompt tokens are exactly the whole blocks the store holds. (With NIXL vLLM reports P's own
prefix-cache hits as D's cached tokens, `remote_prefill_cached_tokens`, so that count proves
nothing about D's load.)"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import serving_cluster as cluster
import serving_kit as kit
from serving_client import Request

pytestmark = pytest.mark.timeout(900)

BLOCK = 128  # vLLM-CPU's block size


def store_loadable(prompt_len: int) -> int:
    """A store serves whole 128-token engine blocks before the prompt's last token."""
    return (prompt_len - 1) // BLOCK * BLOCK


def unshared(workload: list[Request]) -> list[Request]:
    """Requests of 2+ tokens whose first block no other request shares: D has no local prefix
    hit for them in the first round, so each needs a READ from P."""
    firsts = [tuple(r.prompt[:BLOCK]) for r in workload]
    return [r for r, f in zip(workload, firsts) if len(r.prompt) > 1 and firsts.count(f) == 1]


def check_nixl_stats(stats: dict[str, float], workload: list[Request]) -> None:
    reads = stats.get("Num successful transfers", 0)
    assert reads >= len(unshared(workload)), f"too few NIXL READs on D: {stats}"
    assert stats.get("Num failed transfers", 0) == 0, stats


def check_store_stats(stats: dict[str, float], workload: list[Request]) -> None:
    # D loads every loadable token of a prompt sharing no prefix from the store in round 1;
    # shared prefixes may come from D's own prefix cache after the first of their group
    loadable = sum(store_loadable(len(r.prompt)) for r in unshared(workload))
    assert stats.get("loaded_tokens", 0) >= loadable, f"D loaded too little: {stats}"
    assert stats.get("load_errors", 0) == 0, stats


CHECK_STATS: dict[str, Callable[[dict[str, float], list[Request]], None]] = {
    "nixl": check_nixl_stats,
    "file": check_store_stats,
    "redis": check_store_stats,
}


def kv_configs(name: str, fleet: kit.Fleet) -> tuple[dict[str, Any], dict[str, Any]]:
    """P's and D's `--kv-transfer-config` for connector `name`."""
    if name == "nixl":
        extra: dict[str, Any] = {"required_layout": None}
        return (
            kit.kvx_json("NixlConnector", "kv_producer", **extra),
            kit.kvx_json("NixlConnector", "kv_consumer", **extra),
        )
    if name == "file":
        url = f"file://{fleet.log_dir / 'kv-store'}"
    else:
        url = fleet.add(cluster.redis_server(fleet.log_dir)).url
    return (
        kit.kvx_json("SharedStorageConnector", "kv_producer", storage_url=url),
        kit.kvx_json("SharedStorageConnector", "kv_consumer", storage_url=url),
    )


@pytest.fixture(scope="module", params=list(CHECK_STATS))
def pd(
    request: pytest.FixtureRequest,
    long_tiny_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, kit.Deployment]]:
    """1P1D behind the proxy for one connector; its servers stop before the next one starts."""
    fleet = kit.Fleet(tmp_path_factory.mktemp(f"pd-{request.param}"), [])
    try:
        p_kv, d_kv = kv_configs(request.param, fleet)
        yield request.param, kit.deploy(fleet, long_tiny_model, [p_kv], [d_kv])
    finally:
        fleet.stop()


def test_forty_requests_equal_one_engines_tokens_and_d_loads_the_kv(
    pd: tuple[str, kit.Deployment], workload: list[Request], reference: list[list[int]]
) -> None:
    name, dep = pd
    for n, results in enumerate(kit.serve_rounds(dep, workload, reference)):
        if name != "nixl":
            cached = [(len(r.prompt), res.cached_tokens) for r, res in zip(workload, results)]
            want = [(m, store_loadable(m)) for m, _ in cached]
            assert cached == want, f"round {n}: D's cached prompt tokens (got, want)"
    # vLLM logs D's stats once per second, after the steps that produced them
    kit.eventually(lambda: CHECK_STATS[name](kit.logged_stats(dep.decodes[0]), workload))
