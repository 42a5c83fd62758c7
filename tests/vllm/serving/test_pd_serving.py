"""Online prefill/decode through `vllm serve` and `kvx proxy` with each built-in kvx connector: 40
requests (prompts of 1 to 1,500 tokens, shared prefixes, streamed and not, idle gaps between
bursts) all complete with exactly one plain engine's tokens, and D proves it loaded the KV: each
response's cached-token count is what the connector can hand over, and D's logged kvx stats
count the loads."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import serving_cluster as cluster
import serving_kit as kit
from serving_client import Request, run

pytestmark = pytest.mark.timeout(900)

BLOCK = 128  # vLLM-CPU's block size


def nixl_loadable(prompt_len: int) -> int:
    """NIXL hands D every prompt token but the last (D computes that one for the logits)."""
    return prompt_len - 1


def store_loadable(prompt_len: int) -> int:
    """A store serves whole 128-token engine blocks before the prompt's last token."""
    return (prompt_len - 1) // BLOCK * BLOCK


CONNECTORS: dict[str, tuple[Callable[[int], int], str]] = {
    "nixl": (nixl_loadable, "Num successful transfers"),
    "file": (store_loadable, "loaded_tokens"),
    "redis": (store_loadable, "loaded_tokens"),
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


@pytest.fixture(scope="module", params=list(CONNECTORS))
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
    loadable, stat = CONNECTORS[name]
    for round_ in range(kit.ROUNDS):
        results = run(dep.proxy.url, dep.model.name, workload, gap_s=kit.GAP_S)
        bad = kit.mismatches(workload, results, reference)
        assert not bad, f"round {round_}: {len(bad)}/40 requests wrong:\n" + "\n".join(bad)
        cached = [(len(r.prompt), res.cached_tokens) for r, res in zip(workload, results)]
        want = [(n, loadable(n)) for n, _ in cached]
        assert cached == want, f"round {round_}: D's cached prompt tokens (got, want)"
        dead = [s.name for s in [*dep.engines, dep.proxy] if not s.alive]
        assert not dead, f"round {round_}: {dead} died"
    stats = kit.wait_for_stats(dep.decodes[0], stat)
    assert stats[stat] > 0, f"D's kvx stats show no loads: {stats}"
