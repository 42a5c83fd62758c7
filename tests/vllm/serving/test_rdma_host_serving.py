"""A `vllm serve` P/D pair over NIXL behind `kvx proxy` on a host with the distribution's RDMA
libraries (libibverbs1 and its providers, installed privately for these servers only: see
tests/helpers/rdma_libs.py and docs/connectors/nixl.md#troubleshooting). The pair serves one
engine's tokens, D READs the prompts over NIXL, the engine cores' NIXL agents loaded UCX's
InfiniBand module through the wheel's verbs stack but not the EFA module that brings the host's
libnl-route (what crashed NIXL processes at exit), and on SIGTERM every process of both servers
exits cleanly: exit codes 0, no crash reported through PYTHONFAULTHANDLER. (vLLM's engine core
released its agent before exiting even before kvx left EFA out, so the exit codes alone are a
guard: the loaded libraries are what fails without the fix.)"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import serving_checks as checks
import serving_cluster as cluster
import serving_kit as kit
from rdma_libs import FAULTHANDLER, RdmaLibsUnavailable, rdma_env
from serving_client import Request

pytestmark = pytest.mark.timeout(900)

NIXL_EXTRA = {"required_layout": None, "handshake_timeout_s": 5, "transfer_timeout_s": 15}
COUNT = 8  # requests: enough for several READs, few for a shared machine


@pytest.fixture(scope="module")
def rdma_pair(fleet: kit.Fleet, long_tiny_model: Path) -> Iterator[kit.Deployment]:
    try:
        full = rdma_env()
    except RdmaLibsUnavailable as exc:
        pytest.fail(
            f"no host with RDMA libraries can be made here (CI runs these, never skips them): {exc}"
        )
    env = {k: full[k] for k in ("LD_LIBRARY_PATH", *FAULTHANDLER) if k in full}
    servers = []
    for name, role, core in (("P", "kv_producer", "0"), ("D", "kv_consumer", "1")):
        kv = kit.kvx_json("NixlConnector", role, **NIXL_EXTRA)
        servers.append(
            fleet.add(
                cluster.vllm_server(
                    name, long_tiny_model, fleet.log_dir, kv, core, kit.MAX_MODEL_LEN, env=env
                )
            )
        )
    for server in servers:
        server.wait_healthy(kit.START_TIMEOUT_S)
    proxy = fleet.add(
        cluster.proxy_server(
            fleet.log_dir,
            [servers[0].url],
            [servers[1].url],
            extra=("--health-timeout=60", "--request-timeout=120"),
        )
    )
    proxy.wait_healthy(60)
    yield kit.Deployment([servers[0]], [servers[1]], proxy, long_tiny_model)


def group_libs(server: cluster.Server) -> set[str]:
    """The RDMA libraries loaded by any process of `server`'s process group."""
    found: set[str] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getpgid(int(entry)) != server.proc.pid:
                continue
            with open(f"/proc/{entry}/maps") as maps:
                names = {line.split()[-1].rsplit("/", 1)[-1] for line in maps}
        except OSError:  # gone meanwhile
            continue
        found |= {name for name in names if re.match(r"lib(efa|ibverbs|uct_ib)", name)}
    return found


def test_vllm_pd_pair_serves_and_exits_cleanly_with_rdma_libraries(
    rdma_pair: kit.Deployment, workload: list[Request], reference: list[list[int]]
) -> None:
    kit.serve_rounds(rdma_pair, workload[:COUNT], reference[:COUNT])
    p, d = rdma_pair.prefills[0], rdma_pair.decodes[0]

    def d_read() -> None:  # the KV moved over NIXL (how many READs is test_fleet_serving's)
        stats = checks.logged_stats(d)
        assert stats.get("Num successful transfers", 0) >= 1, stats
        assert stats.get("Num failed transfers", 0) == 0, stats

    kit.eventually(d_read)
    for server in (p, d):  # the engine cores' agents loaded UCX's verbs stack, not EFA's
        loaded = group_libs(server)
        assert any(lib.startswith("libibverbs-") for lib in loaded), (server.name, loaded)
        assert not [lib for lib in loaded if lib.startswith("libefa")], (server.name, loaded)
    for server in (d, p):
        server.stop(grace_s=60)
        log = server.log.read_text(errors="replace")
        assert "Fatal Python error" not in log, f"{server.name} crashed:\n{server.tail(80)}"
        assert server.proc.returncode == 0, (
            f"{server.name} exited {server.proc.returncode}:\n{server.tail(80)}"
        )
