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

from kvx.config.transfer import KVTransferConfig
from kvx.contract.types import RequestStatus
from kvx.engine.engine import Engine, EngineConfig
from kvx.engine.scheduler import RequestOutput
from kvx.engine.server import EngineError, EngineHandle, EngineProcess, LocalEngine
from kvx.engine.waiting import EngineStall, wait_until

__all__ = [
    "DisaggReport",
    "DisaggregatedPair",
    "EngineStall",
    "RequestResult",
    "baseline_tokens",
    "pd_configs",
]


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
    layouts: tuple[str, str] | None = None,
    roles: tuple[str, str] = ("kv_producer", "kv_consumer"),
) -> tuple[EngineConfig, EngineConfig]:
    """P and D engine configs sharing a connector config; `roles` (P's, D's `kv_role`) and
    engine ids set per side (the engine id of each side is also its connector's `engine_id`)."""
    sides = []
    for i, (role, name) in enumerate(zip(roles, ("prefill", "decode"), strict=True)):
        engine_id = f"{name}-{uuid.uuid4().hex[:8]}"
        ktc = KVTransferConfig.from_dict({**kv, "kv_role": role, "engine_id": engine_id})
        sides.append(
            replace(
                base,
                tp_size=tp[i],
                block_size=block_sizes[i] if block_sizes else base.block_size,
                layout=layouts[i] if layouts else base.layout,
                engine_id=engine_id,
                kv_transfer_config=ktc,
            )
        )
    return sides[0], sides[1]


class DisaggregatedPair:
    """A prefill engine and a decode engine, each in its own process (or both in this one
    with `processes=False`), and the proxy between them.

    Use `run()` for a batch, or `submit()` / `step()` / `finished()` to act between steps.
    """

    def __init__(
        self,
        prefill: EngineConfig,
        decode: EngineConfig,
        *,
        timeout_s: float = 60.0,
        processes: bool = True,
    ) -> None:
        self.prefill_config, self.decode_config = prefill, decode

        def start(config: EngineConfig, name: str) -> EngineHandle:
            if processes:
                return EngineProcess(config, name=name, timeout_s=timeout_s)
            return LocalEngine(config, name=name)

        self.prefill: EngineHandle = start(prefill, "prefill")
        try:
            self.decode: EngineHandle = start(decode, "decode")
        except Exception:
            self.prefill.close()
            raise
        self.results: dict[str, RequestResult] = {}
        self.kv_mismatches: list[str] = []
        self._prompts: dict[str, list[int]] = {}
        self._max_tokens: dict[str, int] = {}
        self._p_pending = self._d_pending = False
        self._dead: set[str] = set()
        self.on_finished: Callable[[RequestResult], None] | None = None

    def submit(
        self, request_id: str, prompt: list[int], max_tokens: int, baseline: list[int] | None = None
    ) -> None:
        """Send a prompt to P with `do_remote_decode`; D gets it when P returns params."""
        self._prompts[request_id] = list(prompt)
        self._max_tokens[request_id] = max_tokens
        self.results[request_id] = RequestResult(request_id, len(prompt), baseline or [])
        self.prefill.add_request(request_id, prompt, 1, {"do_remote_decode": True})
        self._p_pending = True

    def submit_local(
        self, request_id: str, prompt: list[int], max_tokens: int, baseline: list[int] | None = None
    ) -> None:
        """Send a prompt straight to D, as an ordinary (not disaggregated) request."""
        self.results[request_id] = RequestResult(request_id, len(prompt), baseline or [])
        self.decode.add_request(request_id, prompt, max_tokens)
        self.results[request_id].status = "decoding"
        self._d_pending = True

    def report(self, elapsed_s: float = 0.0) -> DisaggReport:
        """Results so far, the engines' last stats and every KV mismatch seen."""
        return DisaggReport(
            dict(self.results),
            self.prefill.last_stats,
            self.decode.last_stats,
            list(self.kv_mismatches),
            elapsed_s,
        )

    def step(self, check_kv: bool = True) -> bool:
        """One proxy round: step P, forward finished prefills to D, step D, check KV bytes.
        Returns whether either engine produced output."""
        progressed = False
        if "prefill" not in self._dead:
            p_out, self._p_pending = self.prefill.step()
            progressed |= bool(p_out)
            for out in p_out:
                self._on_prefill_output(out)
        decoding = self._d_pending or any(r.status == "decoding" for r in self.results.values())
        if decoding and "decode" not in self._dead:
            d_out, self._d_pending = self.decode.step()
            progressed |= bool(d_out)
            for out in d_out:
                result = self.results.get(out.request_id)
                if result is None:  # a request sent to D directly
                    continue
                result.tokens = out.output_token_ids
                if out.finished:
                    self._finish(result, out.status.value)
        if check_kv:
            for side, handle in (("prefill", self.prefill), ("decode", self.decode)):
                if side not in self._dead:
                    self.kv_mismatches += handle.check_kv()
        return progressed

    def kill(self, side: str) -> None:
        """Kill the prefill or decode process now (fault injection); its requests are lost."""
        handle = self.prefill if side == "prefill" else self.decode
        if not isinstance(handle, EngineProcess):
            raise TypeError("only an engine running in its own process can be killed")
        handle.kill()
        self._dead.add(side)
        lost = "pending" if side == "prefill" else "decoding"
        for result in self.results.values():
            if result.status == lost:
                result.status = f"lost: {side} killed"
        if side == "prefill":
            self._p_pending = False
        else:
            self._d_pending = False

    def finished(self) -> bool:
        """Every submitted request ended and neither engine has work or held blocks left."""
        ended = all(r.status not in ("pending", "decoding") for r in self.results.values())
        return ended and not self._p_pending and not self._d_pending

    def run(
        self,
        prompts: dict[str, list[int]],
        max_tokens: int,
        *,
        check_kv: bool = True,
        timeout_s: float = 300.0,
        stall_s: float | None = None,
        on_finished: Callable[[RequestResult], None] | None = None,
        progress: Callable[[str], None] | None = None,
    ) -> DisaggReport:
        """Send every prompt through P then D; return tokens, stats and KV mismatches. The
        baseline is computed after the run, so a stalled connector fails without waiting for
        it."""
        start = time.perf_counter()
        self.on_finished = on_finished
        for rid, prompt in prompts.items():
            self.submit(rid, prompt, max_tokens)
        self.run_until_finished(
            timeout_s=timeout_s, check_kv=check_kv, stall_s=stall_s, progress=progress
        )
        elapsed = time.perf_counter() - start
        baseline = baseline_tokens(
            replace(self.decode_config, tp_size=1, pp_size=1), prompts, max_tokens
        )
        for rid in prompts:
            self.results[rid].baseline = baseline[rid]
        return self.report(elapsed)

    @property
    def violations(self) -> list[str]:
        """Contract violations both engines recorded so far (see `Scheduler`)."""
        return self.prefill.violations + self.decode.violations

    def run_until_finished(
        self,
        *,
        timeout_s: float = 300.0,
        check_kv: bool = True,
        stall_s: float | None = None,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        """Step until `finished()`; raise `EngineError` after `timeout_s` seconds, or
        `EngineStall` once `stall_s` seconds pass in which no engine produced output and
        neither engine's counters (held and free blocks, loads, ...) changed.

        Rounds that produce no output sleep (1 ms, doubling up to 20 ms while nothing
        happens), so connectors' background threads get the CPU and idle engines do not spin;
        `progress` gets a line every few seconds of a long wait.
        """
        self.run_until(
            self.finished,
            "every request ended",
            timeout_s=timeout_s,
            check_kv=check_kv,
            stall_s=stall_s,
            progress=progress,
        )

    def run_until(
        self,
        done: Callable[[], bool],
        what: str,
        *,
        timeout_s: float = 300.0,
        check_kv: bool = True,
        stall_s: float | None = None,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        """Step until `done()` (described by `what` in errors), bounded as `run_until_finished`
        says."""
        wait_until(
            done,
            lambda: self.step(check_kv),
            self._progress_state,
            what,
            self.describe_unfinished,
            timeout_s=timeout_s,
            stall_s=stall_s,
            progress=progress,
        )

    def _progress_state(self) -> tuple[object, ...]:
        return tuple(
            tuple(sorted((k, v) for k, v in h.last_stats.items() if k != "steps"))
            for h in (self.prefill, self.decode)
        )

    def describe_unfinished(self) -> str:
        """Which requests are not done, what each engine holds and which connector report
        it waits for."""
        open_reqs = [
            f"{r.request_id} ({r.status})"
            for r in self.results.values()
            if r.status in ("pending", "decoding")
        ]
        parts = [f"open requests: {', '.join(open_reqs) or 'none'}"]
        for side, handle in (("prefill", self.prefill), ("decode", self.decode)):
            if side in self._dead:
                parts.append(f"{side}: killed")
                continue
            try:
                lines = handle.diagnose()
            except EngineError as exc:
                lines = [f"could not ask it: {exc}"]
            held = handle.last_stats.get("held_blocks", "?")
            parts.append(
                f"{side} ({handle.name}, {held} blocks held after finish): "
                + ("; ".join(lines) or "idle")
            )
        return "\n  ".join(parts)

    def _finish(self, result: RequestResult, status: str) -> None:
        result.status = status
        if self.on_finished is not None:
            self.on_finished(result)

    def _on_prefill_output(self, out: RequestOutput) -> None:
        result = self.results.get(out.request_id)
        if result is None or not out.finished:
            return
        result.prefill_token = out.output_token_ids[0] if out.output_token_ids else None
        result.kv_transfer_params = out.kv_transfer_params
        if out.status is not RequestStatus.FINISHED_LENGTH_CAPPED:
            self._finish(result, f"prefill {out.status.value}")
            return
        self.decode.add_request(
            out.request_id,
            self._prompts[out.request_id],
            self._max_tokens[out.request_id],
            out.kv_transfer_params,
        )
        self._d_pending = True
        result.status = "decoding"

    def close(self) -> None:
        try:
            self.decode.close()
        finally:
            self.prefill.close()

    def __enter__(self) -> DisaggregatedPair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
