"""Online serving: 1P1D (`vllm serve` P and D with kvx's NixlConnector, `kvx proxy` in front)
against one plain `vllm serve` engine, on the same prompts, in one run.

Both set-ups serve the same streamed completions (token-id prompts of `--min-tokens` to
`--max-tokens` tokens, `--new-tokens` generated each, greedy, `--concurrency` in flight) from
the tiny random Llama the vLLM tests build (tests/vllm/conftest.py), one after the other, so each
has the machine to itself. The single engine may use both cores (VLLM_CPU_OMP_THREADS_BIND
0-1), P and D one each (0 and 1): the same hardware. Reported per set-up: median and p90 time
to first token, median request latency, output tokens per second over the whole run, and the
CPU seconds the servers' process trees used. Tokens are compared between the set-ups (they
must be equal). On a shared machine absolute times are noise; the ratios are the result.

Runs in .venv-vllm (`make venv-vllm`):

    .venv-vllm/bin/python benchmarks/bench_serving.py
    .venv-vllm/bin/python benchmarks/bench_serving.py --requests 16 --plot serving.png
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "vllm" / "serving"))  # the serving tests' helpers
sys.path.insert(0, str(ROOT / "tests" / "vllm"))

import psutil  # noqa: E402  (a vLLM dependency)
import serving_client as client  # noqa: E402
import serving_cluster as cluster  # noqa: E402

MAX_MODEL_LEN = 2048
NIXL = {"required_layout": None}


def kv(role: str) -> dict[str, Any]:
    return {
        "kv_connector": "NixlConnector",
        "kv_connector_module_path": "kvx.adapters.vllm",
        "kv_role": role,
        "kv_connector_extra_config": NIXL,
    }


def cpu_seconds(servers: list[cluster.Server]) -> float:
    total = 0.0
    for server in servers:
        try:
            root = psutil.Process(server.proc.pid)
            for proc in [root, *root.children(recursive=True)]:
                times = proc.cpu_times()
                total += times.user + times.system
        except psutil.NoSuchProcess:
            continue
    return total


def measure(
    name: str, front: str, servers: list[cluster.Server], model: Path, reqs: list[Any], conc: int
) -> dict[str, Any]:
    client.run(front, model.name, reqs[:2], concurrency=conc)  # warm-up, untimed
    cpu0, start = cpu_seconds(servers), time.monotonic()
    results = client.run(front, model.name, reqs, concurrency=conc)
    wall = time.monotonic() - start
    cpu = cpu_seconds(servers) - cpu0
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise SystemExit(f"{name}: {len(failed)} requests failed, first: {failed[0]}")
    ttft = sorted(r.first_token_seconds or r.seconds for r in results)
    return {
        "name": name,
        "ttft_median_ms": 1e3 * statistics.median(ttft),
        "ttft_p90_ms": 1e3 * ttft[int(0.9 * (len(ttft) - 1))],
        "latency_median_ms": 1e3 * statistics.median(r.seconds for r in results),
        "tokens_per_s": sum(len(r.tokens) for r in results) / wall,
        "wall_s": wall,
        "cpu_s": cpu,
        "tokens": [r.tokens for r in results],
    }


def run_single(model: Path, logs: Path, reqs: list[Any], conc: int) -> dict[str, Any]:
    engine = cluster.vllm_server("single", model, logs, None, "0-1", MAX_MODEL_LEN)
    try:
        engine.wait_healthy(600)
        return measure("single engine", engine.url, [engine], model, reqs, conc)
    finally:
        engine.stop()


def run_pd(model: Path, logs: Path, reqs: list[Any], conc: int) -> dict[str, Any]:
    p = cluster.vllm_server("P", model, logs, kv("kv_producer"), "0", MAX_MODEL_LEN)
    d = cluster.vllm_server("D", model, logs, kv("kv_consumer"), "1", MAX_MODEL_LEN)
    servers: list[cluster.Server] = [p, d]
    try:
        p.wait_healthy(600)
        d.wait_healthy(600)
        proxy = cluster.proxy_server(logs, [p.url], [d.url])
        servers.append(proxy)
        proxy.wait_healthy(60)
        return measure("1P1D + kvx proxy (NIXL)", proxy.url, servers, model, reqs, conc)
    finally:
        for server in reversed(servers):
            server.stop()


def table(rows: list[dict[str, Any]]) -> str:
    base = rows[0]
    head = (
        "| set-up | TTFT median ms | TTFT p90 ms | latency median ms | tokens/s | wall s "
        "| server CPU s |"
    )
    lines = [head, "|" + "---|" * 7]
    for r in rows:
        ratio = "" if r is base else f" ({r['tokens_per_s'] / base['tokens_per_s']:.2f}x)"
        lines.append(
            f"| {r['name']} | {r['ttft_median_ms']:.0f} | {r['ttft_p90_ms']:.0f} | "
            f"{r['latency_median_ms']:.0f} | {r['tokens_per_s']:.1f}{ratio} | {r['wall_s']:.1f} | "
            f"{r['cpu_s']:.1f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    names = [r["name"] for r in rows]
    axes[0].bar(names, [r["ttft_median_ms"] for r in rows])
    axes[0].set_ylabel("median time to first token (ms)")
    axes[1].bar(names, [r["tokens_per_s"] for r in rows])
    axes[1].set_ylabel("output tokens / s")
    for ax in axes:
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--min-tokens", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=1500)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", metavar="PNG", help="also draw the table (needs matplotlib)")
    args = ap.parse_args()
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            ap.error("--plot needs matplotlib: pip install matplotlib (the `bench` extra)")
    if not 1 <= args.min_tokens <= args.max_tokens <= MAX_MODEL_LEN - args.new_tokens:
        ap.error(f"need 1 <= --min-tokens <= --max-tokens <= {MAX_MODEL_LEN} - --new-tokens")

    from conftest import build_tiny_llama  # tests/vllm/conftest.py

    rng = random.Random(args.seed)
    reqs = [
        client.Request(
            [rng.randrange(4, 512) for _ in range(rng.randint(args.min_tokens, args.max_tokens))],
            args.new_tokens,
            stream=True,
        )
        for _ in range(args.requests)
    ]
    with tempfile.TemporaryDirectory(prefix="kvx-bench-serving-") as tmp:
        model = build_tiny_llama(Path(tmp) / "tiny-llama", positions=MAX_MODEL_LEN)
        logs = Path(tmp) / "logs"
        logs.mkdir()
        rows = [
            run_single(model, logs, reqs, args.concurrency),
            run_pd(model, logs, reqs, args.concurrency),
        ]
    same = rows[0]["tokens"] == rows[1]["tokens"]
    print(
        f"{args.requests} streamed requests, prompts {args.min_tokens}-{args.max_tokens} tokens, "
        f"{args.new_tokens} new tokens each, {args.concurrency} in flight; tiny Llama, float32"
    )
    print(table(rows))
    print(f"tokens identical between the set-ups: {same}")
    if args.plot:
        plot(rows, args.plot)
        print(f"plot: {args.plot}")
    if not same:
        raise SystemExit("the set-ups generated different tokens")


if __name__ == "__main__":
    main()
