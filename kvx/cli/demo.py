"""`kvx demo`: prefill and decode engines in separate processes, KV moved by a connector.

It sends a handful of prompts of varied lengths through P and D with the chosen connector
(default: the shared-storage connector on a temporary directory, or the example connector
when that is what is installed), shows progress, and ends with a summary: tokens, KV blocks and
bytes moved, throughput, and whether every output is identical to a single engine's.
A run in which decode loaded no KV from prefill demonstrated nothing: it says why and fails.
"""

from __future__ import annotations

import contextlib
import os
import random
import tempfile
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvx.config.transfer import KVTransferConfig, load_cli_arg
from kvx.contract.auxiliary import Capability, KVConnectorRole
from kvx.contract.types import ParallelInfo, Request
from kvx.engine.disagg import DisaggregatedPair, DisaggReport, pd_configs
from kvx.engine.engine import EngineConfig
from kvx.errors import ConfigError, ConfigProblem, did_you_mean
from kvx.registry.core import Registry, create_connector
from kvx.topology import TopologyError
from kvx.topology.heads import check_tp_heads

PROMPT_LENGTHS = (5, 16, 37, 64, 100, 150, 257)
TMP_PLACEHOLDER = "{tmp}"  # as in `kvx conformance`: the demo's own temporary directory
EXIT_NOTHING_MOVED = 1
DEFAULT_CONNECTORS = ("SharedStorageConnector", "ExamplePDConnector")


@dataclass(frozen=True)
class DemoOptions:
    kv_transfer_config: str | None = None
    tp: str = "1:1"
    num_prompts: int = 7
    max_tokens: int = 8
    layout: str = "NHD"
    block_size: int = 16
    seed: int = 0


MAX_TP = 16
"""Largest demo TP size: every rank is a process on this machine."""


def parse_tp(text: str, num_kv_heads: int | None = None) -> tuple[int, int]:
    """`"P:D"` -> (P, D) tensor-parallel sizes (each 1-16, and fitting `num_kv_heads`)."""
    parts = text.split(":")
    if len(parts) != 2 or not all(p.isdigit() and 0 < int(p) <= MAX_TP for p in parts):
        raise ConfigError(
            [
                ConfigProblem(
                    "--tp",
                    f"{text!r} is not of the form P:D with integers 1-{MAX_TP}, e.g. 2:1",
                )
            ]
        )
    sizes = int(parts[0]), int(parts[1])
    if num_kv_heads is not None:
        for size in sizes:
            try:
                check_tp_heads(num_kv_heads, size)
            except TopologyError as exc:
                raise ConfigError([ConfigProblem("--tp", f"{text!r}: {exc}")]) from None
    return sizes


def default_kv_config(registry: Registry, workdir: Path) -> dict[str, Any]:
    """The embedded default: the first installed of `DEFAULT_CONNECTORS` on `workdir`."""
    connectors = registry.connectors()
    if "SharedStorageConnector" in connectors:
        return {
            "kv_connector": "SharedStorageConnector",
            "kv_connector_extra_config": {"storage_url": f"file://{workdir}"},
        }
    if "ExamplePDConnector" in connectors:
        return {
            "kv_connector": "ExamplePDConnector",
            "kv_connector_extra_config": {"directory": str(workdir)},
        }
    raise ConfigError(
        [
            ConfigProblem(
                "--kv-transfer-config",
                "no default connector is "
                f"installed (one of {', '.join(DEFAULT_CONNECTORS)}); "
                "pass --kv-transfer-config",
            )
        ]
    )


def expand_tmp(value: Any, tmp: str) -> Any:
    """Replace `{tmp}` in every string of a JSON-like value with `tmp`."""
    if isinstance(value, str):
        return value.replace(TMP_PLACEHOLDER, tmp)
    if isinstance(value, list):
        return [expand_tmp(v, tmp) for v in value]
    if isinstance(value, dict):
        return {k: expand_tmp(v, tmp) for k, v in value.items()}
    return value


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    return []


def stored_after_run(
    decode: EngineConfig, prompts: dict[str, list[int]], registry: Registry
) -> int:
    """Tokens of `prompts` a fresh decode-side connector finds stored now, after the run (0
    when the connector finds nothing or cannot be asked)."""
    ktc = decode.kv_transfer_config
    if ktc is None:
        return 0
    connector = create_connector(
        ktc,
        KVConnectorRole.SCHEDULER,
        decode.context(ParallelInfo(tp_size=decode.tp_size)),
        registry=registry,
    )
    try:
        found = 0
        for rid, prompt in prompts.items():
            count, _ = connector.get_num_new_matched_tokens(Request(f"probe-{rid}", prompt), 0)
            found += count or 0
        return found
    finally:
        connector.shutdown()


def why_nothing_moved(
    kv: dict[str, Any], claims: Collection[Capability], stored_after: int | None = None
) -> str:
    """The likeliest reason decode loaded no KV from prefill with connector config `kv`;
    `stored_after`: tokens of the prompts decode's connector finds stored after the run."""
    name = kv.get("kv_connector", "the connector")
    if stored_after:
        return (
            f"prefill saved nothing before its requests finished: decode looked the prompts "
            f"up as each finished and found none, yet {stored_after} of their tokens are "
            f"stored now. {name} must save a prompt's KV during the forward (save_kv_layer / "
            "wait_for_save), or hold its blocks (request_finished returning True) until saved"
        )
    if not {Capability.REMOTE_PREFILL, Capability.STORE_REUSE} & set(claims):
        return (
            f"{name} claims neither 'remote_prefill' nor 'store_reuse' "
            f"(it claims: {', '.join(sorted(claims)) or 'nothing'}), so it never moves KV "
            "between engines; it serves one engine (e.g. offloading to CPU or disk). Use a "
            "P/D connector such as SharedStorageConnector or NixlConnector"
        )
    if any(s.startswith("memory://") for s in _strings(kv)):
        return (
            "memory:// storage lives in each process's own memory, so what prefill saved is "
            "invisible to decode in its own process; use a shared store such as "
            "file://{tmp}/kv or redis://127.0.0.1:6379/0"
        )
    if stored_after == 0 and Capability.REMOTE_PREFILL not in claims:
        return (
            "prefill saved nothing decode can find, not even after the run. A connector must "
            "save a prompt's KV in the forward that computes it (save_kv_layer / "
            "wait_for_save): saves planned after request_finished never run once prefill "
            "stops stepping. Else check that both engines reach the same storage (URL, "
            "directory), that prefill's role saves (kv_producer or kv_both), and that prompts "
            "are longer than --block-size (stores keep full blocks or chunks only)"
        )
    return (
        "decode found none of prefill's KV: check that both engines reach the same storage or "
        "peer (URL, directory, host and port), and that prompts are longer than --block-size "
        "(some connectors move full blocks only)"
    )


def make_prompts(count: int, seed: int, vocab: int) -> dict[str, list[int]]:
    """Prompts of varied lengths; the last one shares a prefix with the longest."""
    rng = random.Random(seed)
    prompts = {}
    for i in range(count):
        length = PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)]
        prompts[f"req-{i}"] = [rng.randrange(vocab) for _ in range(length)]
    if count >= 2:
        longest = max(prompts.values(), key=len)
        prompts[f"req-{count - 1}"] = [*longest[: len(longest) // 2 + 3], 1, 2, 3]
    return prompts


@contextlib.contextmanager
def quiet_nixl_info() -> Iterator[None]:
    """NIXL logs INFO lines to stdout from both engines, into the demo's progress and table:
    show only its errors unless the user chose a level (`NIXL_LOG_LEVEL=INFO kvx demo ...`)."""
    if "NIXL_LOG_LEVEL" in os.environ:
        yield
        return
    os.environ["NIXL_LOG_LEVEL"] = "ERROR"  # a level both NIXL's Python and C++ loggers know
    try:
        yield
    finally:
        os.environ.pop("NIXL_LOG_LEVEL", None)


def run_demo(options: DemoOptions, registry: Registry, console: Console) -> int:
    """Run the demo; 0 when KV moved and every output matches the baseline, 1 otherwise."""
    with quiet_nixl_info():
        return _run_demo(options, registry, console)


def _run_demo(options: DemoOptions, registry: Registry, console: Console) -> int:
    tp = parse_tp(options.tp, EngineConfig().num_kv_heads)
    layouts = registry.layouts()
    if options.layout not in layouts:
        raise ConfigError(
            [
                ConfigProblem(
                    "--layout",
                    f"{options.layout!r} is not a registered layout; allowed: "
                    f"{', '.join(sorted(layouts))}{did_you_mean(options.layout, layouts)}",
                )
            ]
        )
    with tempfile.TemporaryDirectory(prefix="kvx-demo-") as workdir:
        if options.kv_transfer_config:
            kv = load_cli_arg(options.kv_transfer_config)
            if not isinstance(kv, dict):
                raise ConfigError([ConfigProblem("", "expected a JSON object")])
            kv = expand_tmp(kv, workdir)
        else:
            kv = default_kv_config(registry, Path(workdir))
        kv = {k: v for k, v in kv.items() if k != "kv_role"}
        probe = KVTransferConfig.from_dict({**kv, "kv_role": "kv_both"}, registry=registry)
        claims = registry.resolve_connector_class(probe).claims_for(probe)
        if tp[0] != tp[1] and Capability.HETERO_TP not in claims:
            raise ConfigError(
                [
                    ConfigProblem(
                        "--tp",
                        f"{kv['kv_connector']} does not claim "
                        "heterogeneous TP; use equal sizes such as "
                        f"{tp[1]}:{tp[1]}",
                    )
                ]
            )
        base = EngineConfig(
            layout=options.layout, block_size=options.block_size, num_blocks=512, seed=options.seed
        )
        prefill, decode = pd_configs(base, kv, tp)
        prompts = make_prompts(options.num_prompts, options.seed, base.vocab_size)
        console.print(
            f"kvx demo: {kv['kv_connector']} moving KV from prefill (TP "
            f"{tp[0]}) to decode (TP {tp[1]}), {len(prompts)} prompts, "
            f"layout {options.layout}, block size {options.block_size}"
        )
        pair = DisaggregatedPair(prefill, decode)
        try:
            with Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=console,
                transient=False,
            ) as progress:
                task = progress.add_task("requests", total=len(prompts))
                report = pair.run(
                    prompts, options.max_tokens, on_finished=lambda _: progress.advance(task)
                )
        finally:
            pair.close()
    moved = int(report.decode_stats.get("external_blocks", 0)) > 0
    stored_after = None
    if not moved and Capability.REMOTE_PREFILL not in claims:
        stored_after = stored_after_run(decode, prompts, registry)
    console.print(summary_table(report, base, kv["kv_connector"], moved))
    for line in report.kv_mismatches[:5]:
        console.print(f"[red]KV mismatch:[/] {line}", highlight=False)
    if not moved:
        console.print(
            "[yellow]warning:[/] no KV moved from prefill to decode: decode recomputed every "
            "prompt, so this run shows nothing about the connector. Why: "
            + why_nothing_moved(kv, claims, stored_after),
            highlight=False,
        )
        return EXIT_NOTHING_MOVED
    return 0 if report.all_identical else 1


def summary_table(
    report: DisaggReport, base: EngineConfig, connector: str, moved: bool = True
) -> Table:
    """The demo's summary; when nothing `moved`, the checks say they checked no transfer."""
    results = report.results.values()
    prompt_tokens = sum(r.prompt_len for r in results)
    generated = sum(len(r.tokens) for r in results)
    loaded = int(report.decode_stats.get("external_tokens", 0))
    blocks = int(report.decode_stats.get("external_blocks", 0))
    elem = 2 if base.dtype in ("float16", "bfloat16") else 4
    kv_bytes = loaded * base.num_layers * 2 * base.num_kv_heads * base.head_size * elem
    seconds = max(report.elapsed_s, 1e-9)
    table = Table(title=f"kvx demo summary ({connector})", title_justify="left")
    table.add_column("metric")
    table.add_column("value", justify="right")
    identical = sum(r.identical for r in results)
    rows = [
        ("requests", f"{len(report.results)}"),
        ("prompt tokens", f"{prompt_tokens}"),
        ("generated tokens", f"{generated}"),
        ("tokens loaded by decode", f"{loaded}"),
        ("KV blocks moved", f"{blocks}"),
        ("KV bytes moved", f"{kv_bytes / 2**20:.2f} MiB"),
        ("throughput (end to end)", f"{(prompt_tokens + generated) / seconds:.0f} tokens/s"),
        ("wall time", f"{report.elapsed_s:.2f} s"),
        ("KV saves failed", f"{int(report.prefill_stats.get('kv_save_errors', 0))}"),
        (
            "KV byte checks",
            f"{len(report.kv_mismatches)} mismatches"
            if report.kv_mismatches
            else "passed"
            if moved
            else "no moved KV to check",
        ),
        (
            "outputs identical to baseline",
            f"no ({identical}/{len(report.results)})"
            if not report.all_identical
            else "yes"
            if moved
            else "only by recomputing (no KV moved)",
        ),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table
