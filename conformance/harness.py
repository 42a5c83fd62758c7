"""What scenarios use: engine pairs built from the connector config under test, prompts, checks."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvx import Capability, KVTransferConfig, Registry
from kvx.conformance.scenario import check
from kvx.engine.disagg import DisaggregatedPair, DisaggReport, baseline_tokens, pd_configs
from kvx.engine.engine import EngineConfig

TMP_PLACEHOLDER = "{tmp}"


def substitute(value: Any, tmp: str) -> Any:
    """Replace `{tmp}` in every string of a JSON-like value (a fresh directory per scenario)."""
    if isinstance(value, str):
        return value.replace(TMP_PLACEHOLDER, tmp)
    if isinstance(value, list):
        return [substitute(v, tmp) for v in value]
    if isinstance(value, dict):
        return {k: substitute(v, tmp) for k, v in value.items()}
    return value


class Harness:
    """One scenario's view of the connector under test."""

    def __init__(
        self,
        kv: dict[str, Any],
        claims: frozenset[Capability],
        workdir: Path,
        registry: Registry,
        fault_timeout_s: float = 60.0,
    ) -> None:
        self.kv = substitute({k: v for k, v in kv.items() if k != "kv_role"}, str(workdir))
        self.claims = claims
        self.workdir = workdir
        self.registry = registry
        self.fault_timeout_s = fault_timeout_s
        self.base = EngineConfig(
            num_layers=2,
            num_kv_heads=4,
            head_size=16,
            block_size=16,
            num_blocks=128,
            max_num_batched_tokens=512,
        )

    def kv_with(self, **fields: Any) -> dict[str, Any]:
        return {**self.kv, **fields}

    def engine_config(self, role: str, **overrides: Any) -> EngineConfig:
        """A config for one engine with the connector in `role` (e.g. `kv_both`)."""
        ktc = KVTransferConfig.from_dict({**self.kv, "kv_role": role}, registry=self.registry)
        return replace(self.base, kv_transfer_config=ktc, **overrides)

    @contextmanager
    def pair(
        self,
        *,
        tp: tuple[int, int] = (1, 1),
        block_sizes: tuple[int, int] | None = None,
        layouts: tuple[str, str] | None = None,
        processes: bool = False,
        policy: str | None = None,
        prefill: dict[str, Any] | None = None,
        decode: dict[str, Any] | None = None,
        **engine: Any,
    ) -> Iterator[DisaggregatedPair]:
        """A prefill/decode pair; `prefill` / `decode` override engine fields per side."""
        kv = self.kv_with(kv_load_failure_policy=policy) if policy else self.kv
        p, d = pd_configs(replace(self.base, **engine), kv, tp, block_sizes, layouts)
        pair = DisaggregatedPair(
            replace(p, **(prefill or {})),
            replace(d, **(decode or {})),
            processes=processes,
            timeout_s=self.fault_timeout_s,
        )
        try:
            yield pair
        finally:
            pair.close()

    def prompts(
        self, lengths: list[int], seed: int = 0, prefix: list[int] | None = None, name: str = "req"
    ) -> dict[str, list[int]]:
        rng = random.Random(seed)
        return {
            f"{name}-{i}": (prefix or []) + [rng.randrange(self.base.vocab_size) for _ in range(n)]
            for i, n in enumerate(lengths)
        }

    def baseline(
        self, prompts: dict[str, list[int]], max_tokens: int, **engine: Any
    ) -> dict[str, list[int]]:
        """A single engine's tokens; `engine` overrides model fields such as `num_kv_heads`."""
        return baseline_tokens(replace(self.base, **engine), prompts, max_tokens)

    def run_pair(
        self, pair: DisaggregatedPair, prompts: dict[str, list[int]], max_tokens: int = 6
    ) -> DisaggReport:
        report = pair.run(prompts, max_tokens, timeout_s=self.fault_timeout_s * 3)
        self.expect_identical(report)
        self.expect_drained(pair)
        return report

    @staticmethod
    def expect_identical(report: DisaggReport) -> None:
        check(
            not report.kv_mismatches,
            f"KV bytes differ from what the prefill engine computed: {report.kv_mismatches[:3]}",
        )
        for r in report.results.values():
            check(
                r.status == "finished_length_capped",
                f"request {r.request_id} ended as {r.status!r}, expected finished_length_capped",
            )
            check(
                r.tokens == r.baseline,
                f"request {r.request_id} (prompt {r.prompt_len} tokens): decode produced "
                f"{r.tokens}, a single engine produced {r.baseline}: the loaded KV is wrong",
            )

    @staticmethod
    def expect_drained(pair: DisaggregatedPair) -> None:
        """Both engines hold nothing: every block back in the free pool."""
        for handle, config in (
            (pair.prefill, pair.prefill_config),
            (pair.decode, pair.decode_config),
        ):
            stats = handle.last_stats
            if not stats:
                continue
            check(
                stats["held_blocks"] == 0,
                f"{handle.name} still holds {stats['held_blocks']} blocks after every request "
                "ended (a connector never reported them finished)",
            )
            check(
                stats["free_blocks"] == config.num_blocks,
                f"{handle.name} leaked blocks: {stats['free_blocks']} of {config.num_blocks} "
                "free after every request ended",
            )
