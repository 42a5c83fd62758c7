"""Disaggregated prefill/decode with the reference engine: P and D in their own processes.

The proxy here does what vLLM's toy proxy does: it sends each prompt to P with
`do_remote_decode` and one output token, forwards the `kv_transfer_params` P returns into D's
request, and lets D generate. A single engine without a connector gives the baseline tokens to
compare with; after every step both engines check their KV bytes against the model.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from kvx.config import KVTransferConfig
from kvx.engine.engine import Engine, EngineConfig
from kvx.engine.scheduler import RequestOutput
from kvx.engine.server import EngineError, EngineProcess
from kvx.types import RequestStatus


def baseline_tokens(
    config: EngineConfig, prompts: dict[str, list[int]], max_tokens: int
) -> dict[str, list[int]]:
    """Tokens a single engine without a connector generates for each prompt."""
    engine = Engine(replace(config, kv_transfer_config=None))
    for req_id, prompt in prompts.items():
        engine.add_request(req_id, prompt, max_tokens)
    done: dict[str, list[int]] = {}
    while engine.has_pending_work():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.output_token_ids
    return done


@dataclass
class RequestResult:
    """One request's journey through P and D."""

    request_id: str
    prompt_len: int
    baseline: list[int]
    prefill_token: int | None = None
    tokens: list[int] = field(default_factory=list)
    status: str = "pending"
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def identical(self) -> bool:
        return self.status == RequestStatus.FINISHED_LENGTH_CAPPED.value and (
            self.tokens == self.baseline
        )


@dataclass
class DisaggReport:
    results: dict[str, RequestResult]
    prefill_stats: dict[str, Any]
    decode_stats: dict[str, Any]
    kv_mismatches: list[str]
    elapsed_s: float

    @property
    def all_identical(self) -> bool:
        return all(r.identical for r in self.results.values()) and not self.kv_mismatches


def pd_configs(
    base: EngineConfig,
    kv: dict[str, Any],
    tp: tuple[int, int] = (1, 1),
    block_sizes: tuple[int, int] | None = None,
) -> tuple[EngineConfig, EngineConfig]:
    """P and D engine configs sharing a connector config; roles and engine ids set per side
    (the engine id of each side is also its connector's `engine_id`)."""
    sides = []
    for role, name, tp_size, block_size in (
        ("kv_producer", "prefill", tp[0], block_sizes[0] if block_sizes else base.block_size),
        ("kv_consumer", "decode", tp[1], block_sizes[1] if block_sizes else base.block_size),
    ):
        engine_id = f"{name}-{uuid.uuid4().hex[:8]}"
        ktc = KVTransferConfig.from_dict({**kv, "kv_role": role, "engine_id": engine_id})
        sides.append(
            replace(
                base,
                tp_size=tp_size,
                block_size=block_size,
                engine_id=engine_id,
                kv_transfer_config=ktc,
            )
        )
    return sides[0], sides[1]


class DisaggregatedPair:
    """A prefill engine and a decode engine, each in its own process, and the proxy logic."""

    def __init__(self, prefill: EngineConfig, decode: EngineConfig, timeout_s: float = 60.0):
        self.prefill_config, self.decode_config = prefill, decode
        self.prefill = EngineProcess(prefill, name="prefill", timeout_s=timeout_s)
        try:
            self.decode = EngineProcess(decode, name="decode", timeout_s=timeout_s)
        except Exception:
            self.prefill.close()
            raise

    def run(
        self,
        prompts: dict[str, list[int]],
        max_tokens: int,
        *,
        check_kv: bool = True,
        max_steps: int = 10_000,
        on_finished: Callable[[RequestResult], None] | None = None,
    ) -> DisaggReport:
        """Send every prompt through P then D; return tokens, stats and KV mismatches."""
        start = time.perf_counter()
        baseline = baseline_tokens(
            replace(self.decode_config, tp_size=1, pp_size=1), prompts, max_tokens
        )
        results = {rid: RequestResult(rid, len(p), baseline[rid]) for rid, p in prompts.items()}
        for rid, prompt in prompts.items():
            self.prefill.add_request(rid, prompt, 1, {"do_remote_decode": True})
        mismatches: list[str] = []
        p_pending = d_pending = True
        for _ in range(max_steps):
            p_out, p_pending = self.prefill.step()
            for out in p_out:
                self._on_prefill_output(
                    out, results[out.request_id], prompts, max_tokens, on_finished
                )
            if any(r.status == "decoding" for r in results.values()) or d_pending:
                d_out, d_pending = self.decode.step()
                for out in d_out:
                    result = results[out.request_id]
                    result.tokens = out.output_token_ids
                    if out.finished:
                        result.status = out.status.value
                        if on_finished is not None:
                            on_finished(result)
            if check_kv:
                mismatches += self.prefill.check_kv() + self.decode.check_kv()
            done = all(r.status not in ("pending", "decoding") for r in results.values())
            if done and not p_pending and not d_pending:
                break
        else:
            raise EngineError(f"disaggregated run did not finish within {max_steps} steps")
        return DisaggReport(
            results,
            self.prefill.last_stats,
            self.decode.last_stats,
            mismatches,
            time.perf_counter() - start,
        )

    def _on_prefill_output(
        self,
        out: RequestOutput,
        result: RequestResult,
        prompts: dict[str, list[int]],
        max_tokens: int,
        on_finished: Callable[[RequestResult], None] | None,
    ) -> None:
        if not out.finished:
            return
        result.prefill_token = out.output_token_ids[0] if out.output_token_ids else None
        result.kv_transfer_params = out.kv_transfer_params
        if out.status is not RequestStatus.FINISHED_LENGTH_CAPPED:
            result.status = f"prefill {out.status.value}"
            if on_finished is not None:
                on_finished(result)
            return
        self.decode.add_request(
            out.request_id, prompts[out.request_id], max_tokens, out.kv_transfer_params
        )
        result.status = "decoding"

    def close(self) -> None:
        try:
            self.decode.close()
        finally:
            self.prefill.close()
