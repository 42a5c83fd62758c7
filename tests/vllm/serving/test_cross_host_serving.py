"""P and D on two "hosts": two network namespaces joined by a veth pair, created and removed by
this module (root is needed; without it the tests fail with the reason, they never skip). P
runs in A, D and the proxy in B, the client in B too (the test process's namespace has no route
to those addresses). NIXL runs over UCX's TCP transport (`UCX_TLS=tcp`; otherwise UCX would use
shared memory between namespaces of one machine), Redis in A serves D in B; the bytes received on
B's veth end prove that D's KV crossed the link.

These are also the online P/D tests of NIXL over TCP and of the redis store: the workload's
tokens equal one engine's (`KVX_SERVING_ROUNDS` rounds), D's logged stats show a READ per prompt
sharing no prefix (NIXL) or every loadable token (redis), and with redis each response's cached
prompt tokens are exactly the whole blocks the store holds.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest
import serving_checks as checks
import serving_cluster as cluster
import serving_kit as kit
from serving_client import Request, Result

pytestmark = pytest.mark.timeout(900)

KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 32 * 4  # layers x (K, V) x KV heads x head size x float32
CLIENT = Path(__file__).with_name("serving_client.py")


@dataclass
class Link:
    """Namespaces `a` and `b`, veth ends `veth_a` (address `ip_a`) and `veth_b` (`ip_b`)."""

    a: str
    b: str
    veth_a: str
    veth_b: str
    ip_a: str
    ip_b: str

    def rx_bytes_b(self) -> int:
        out = subprocess.run(
            ["ip", "-n", self.b, "-s", "-j", "link", "show", self.veth_b],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return int(json.loads(out)[0]["stats64"]["rx"]["bytes"])


def sh(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(
            f"cannot set up the two-namespace network (root and iproute2 are needed): "
            f"`{' '.join(argv)}` exited {done.returncode}: {done.stderr.strip()}"
        )


@pytest.fixture(scope="module")
def link() -> Iterator[Link]:
    tag = f"{os.getpid() % 100000}{random.randrange(100):02d}"
    net = f"10.{random.randrange(200, 250)}.{random.randrange(256)}"
    ln = Link(f"kvxa{tag}", f"kvxb{tag}", f"kva{tag}", f"kvb{tag}", f"{net}.1", f"{net}.2")
    try:
        sh("ip", "netns", "add", ln.a)
        sh("ip", "netns", "add", ln.b)
        sh("ip", "link", "add", ln.veth_a, "type", "veth", "peer", "name", ln.veth_b)
        sh("ip", "link", "set", ln.veth_a, "netns", ln.a)
        sh("ip", "link", "set", ln.veth_b, "netns", ln.b)
        for ns, dev, ip in ((ln.a, ln.veth_a, ln.ip_a), (ln.b, ln.veth_b, ln.ip_b)):
            sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield ln
    finally:
        for ns in (ln.a, ln.b):  # removing a namespace removes its veth end (and the pair)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.fixture
def xfleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[kit.Fleet]:
    """Each test's own servers, stopped when it ends (pass or fail), before the next starts."""
    fleet = kit.Fleet(tmp_path_factory.mktemp("xhost"), [])
    try:
        yield fleet
    finally:
        fleet.stop()


def deploy_across(
    fleet: kit.Fleet, link: Link, model: Path, p_kv: dict[str, Any], d_kv: dict[str, Any]
) -> kit.Deployment:
    tcp = {"UCX_TLS": "tcp"}
    p = fleet.add(
        cluster.vllm_server(
            "P", model, fleet.log_dir, p_kv, "0", kit.MAX_MODEL_LEN, link.ip_a, link.a, tcp
        )
    )
    d = fleet.add(
        cluster.vllm_server(
            "D", model, fleet.log_dir, d_kv, "1", kit.MAX_MODEL_LEN, netns=link.b, env=tcp
        )
    )
    p.wait_healthy(kit.START_TIMEOUT_S, client_netns=link.b)
    d.wait_healthy(kit.START_TIMEOUT_S, client_netns=link.b)
    proxy = fleet.add(
        cluster.proxy_server(
            fleet.log_dir, [p.url], [d.url], netns=link.b, extra=("--health-interval=1",)
        )
    )
    proxy.wait_healthy(60, client_netns=link.b)
    return kit.Deployment([p], [d], proxy, model)


def run_in(ns: str, dep: kit.Deployment, workload: list[Request]) -> list[Result]:
    """The workload sent from inside namespace `ns` (serving_client.py as a script)."""
    client_args = [dep.proxy.url, dep.model.name, str(kit.GAP_S)]
    done = subprocess.run(
        [*cluster.netns_prefix(ns), sys.executable, str(CLIENT), *client_args],
        input=json.dumps([asdict(r) for r in workload]),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"client in {ns} exited {done.returncode}: {done.stderr[-3000:]}"
    fields = {"tokens", "cached_tokens", "error", "seconds", "first_token_seconds"}
    return [Result(**{k: v for k, v in r.items() if k in fields}) for r in json.loads(done.stdout)]


def nixl_json(role: str, **extra: Any) -> dict[str, Any]:
    return kit.kvx_json("NixlConnector", role, required_layout=None, **extra)


def test_nixl_over_tcp_between_namespaces(
    link: Link,
    xfleet: kit.Fleet,
    long_tiny_model: Path,
    workload: list[Request],
    reference: list[list[int]],
) -> None:
    dep = deploy_across(
        xfleet,
        link,
        long_tiny_model,
        nixl_json("kv_producer", side_channel_host=link.ip_a),
        # kvx's NIXL agent limits UCX to the interface of side_channel_host (loopback by
        # default), on D too: D names its own veth address to reach P across the link
        nixl_json("kv_consumer", side_channel_host=link.ip_b),
    )
    rx0 = link.rx_bytes_b()
    kit.serve_rounds(dep, workload, reference, send=lambda: run_in(link.b, dep, workload))
    received = link.rx_bytes_b() - rx0
    needing = checks.unshared(workload)
    kit.eventually(lambda: checks.check_nixl_reads(checks.logged_stats(dep.decodes[0]), needing))
    read = sum(
        float(m.group(1)) * float(m.group(2))
        for m in re.finditer(
            r"Num successful transfers=(\d+), .*?Avg MB per transfer=([0-9.e-]+)",
            dep.decodes[0].log.read_text(errors="replace"),
        )
    )
    assert read > 1, f"D read only {read:.2f} MB over NIXL"
    assert received >= read * 2**20, f"B's veth received {received} bytes, D read {read:.1f} MB"


def test_redis_in_the_other_namespace(
    link: Link,
    xfleet: kit.Fleet,
    long_tiny_model: Path,
    workload: list[Request],
    reference: list[list[int]],
) -> None:
    redis = xfleet.add(cluster.redis_server(xfleet.log_dir, host=link.ip_a, netns=link.a))
    store = {"storage_url": redis.url}  # type: ignore[attr-defined]
    dep = deploy_across(
        xfleet,
        link,
        long_tiny_model,
        kit.kvx_json("SharedStorageConnector", "kv_producer", **store),
        kit.kvx_json("SharedStorageConnector", "kv_consumer", **store),
    )
    rx0 = link.rx_bytes_b()
    rounds = kit.serve_rounds(dep, workload, reference, send=lambda: run_in(link.b, dep, workload))
    received = link.rx_bytes_b() - rx0
    checks.check_store_cached_tokens(workload, rounds)
    loadable = sum(checks.store_loadable(len(r.prompt)) for r in checks.unshared(workload))
    kit.eventually(lambda: checks.check_store_loads(checks.logged_stats(dep.decodes[0]), workload))
    assert received >= loadable * KV_BYTES_PER_TOKEN, (
        f"B's veth received {received} bytes, less than the {loadable} tokens' KV D loaded"
    )
