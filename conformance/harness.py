"""What scenarios use: engine pairs built from the connector config under test, prompts, checks."""

from __future__ import annotations

import random
import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvx import Capability, KVTransferConfig, Registry
from kvx.conformance.options import SuiteOptions
from kvx.conformance.scenario import ScenarioFailure, check
from kvx.engine.disagg import DisaggregatedPair, DisaggReport, baseline_tokens, pd_configs
from kvx.engine.engine import Engine, EngineConfig
from kvx.engine.waiting import wait_until

PD_ROLES = ("kv_producer", "kv_consumer")
# P/D through a store must show D loading from it: a prompt this long spans a whole chunk of
# every store connector's documented default (LMCache: 256 tokens) plus a partial one.
STORE_PD_PROOF_TOKENS = 300
# Free lists start shuffled (as in a long-running engine) so a request's blocks are scattered:
# in every engine of every scenario.
PREFILL_FREE_LIST_SEED, DECODE_FREE_LIST_SEED, ENGINE_FREE_LIST_SEED = 101, 202, 303

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
    """One scenario's view of the connector under test.

    Each engine gets the `kv_role` its scenario documents (docs/conformance.md), whatever role
    the config names: a P/D pair is P `kv_producer` and D `kv_consumer` unless the scenario says
    otherwise. Every engine built here is watched: contract violations it records fail the
    scenario, and `describe()` says what each open engine holds when a scenario runs out of time.
    """

    def __init__(
        self,
        kv: dict[str, Any],
        claims: frozenset[Capability],
        workdir: Path,
        registry: Registry,
        options: SuiteOptions | None = None,
        name: str = "",
    ) -> None:
        self.kv = substitute({k: v for k, v in kv.items() if k != "kv_role"}, str(workdir))
        self.claims = claims
        self.workdir = workdir
        self.registry = registry
        self.name = name
        self.options = options or SuiteOptions()
        # P/D scenarios go through the store when the connector has no hand-off to offer.
        self.via_store = Capability.STORE_PD in claims and Capability.REMOTE_PREFILL not in claims
        # While a fault is handled the connector may legitimately wait (a lease, a timeout):
        # the stall limit then stretches by what the connector class declares.
        ktc = KVTransferConfig.from_dict({**self.kv, "kv_role": "kv_both"}, registry=registry)
        declared = registry.resolve_connector_class(ktc).fault_wait_s(ktc)
        self.fault_stall_s = self.options.stall_timeout_s + declared
        self.fault_timeout_s = max(
            self.options.fault_timeout_s, 2 * declared + self.options.stall_timeout_s
        )
        self._open_pairs: list[DisaggregatedPair] = []
        self._open_engines: list[Engine] = []
        # Every scenario names its own model: stores key by model name, so what an earlier
        # scenario (or run) left in a store every scenario reaches (one Redis, a process's
        # LMCache tier) is never found here, and no scenario passes on another's saves.
        self.base = EngineConfig(
            model_name=f"kvx-toy-{name or 'scenario'}-{uuid.uuid4().hex[:8]}",
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
        """A config for one engine with the connector in `role` (e.g. `kv_both`); its free
        list starts fragmented."""
        ktc = KVTransferConfig.from_dict({**self.kv, "kv_role": role}, registry=self.registry)
        fields = {"free_list_seed": ENGINE_FREE_LIST_SEED, **overrides}
        return replace(self.base, kv_transfer_config=ktc, **fields)

    @contextmanager
    def engine(self, role: str, **overrides: Any) -> Iterator[Engine]:
        """One engine with the connector in `role`; shut down (and forgotten) on exit."""
        engine = Engine(self.engine_config(role, **overrides), registry=self.registry)
        self._open_engines.append(engine)
        try:
            yield engine
        finally:
            self._open_engines.remove(engine)
            engine.shutdown()

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
        roles: tuple[str, str] = PD_ROLES,
        **engine: Any,
    ) -> Iterator[DisaggregatedPair]:
        """A prefill/decode pair with `roles` (P's, D's); `prefill` / `decode` override engine
        fields per side. Both free lists start fragmented."""
        kv = self.kv_with(kv_load_failure_policy=policy) if policy else self.kv
        p, d = pd_configs(replace(self.base, **engine), kv, tp, block_sizes, layouts, roles)
        pair = DisaggregatedPair(
            replace(p, **{"free_list_seed": PREFILL_FREE_LIST_SEED, **(prefill or {})}),
            replace(d, **{"free_list_seed": DECODE_FREE_LIST_SEED, **(decode or {})}),
            processes=processes,
            timeout_s=self.fault_timeout_s,
        )
        self._open_pairs.append(pair)
        try:
            yield pair
        except Exception as exc:  # a violation is the cause to name, not what it led to
            named = _violated(pair.violations)
            if pair.violations and named not in str(exc):  # e.g. a wrong token it led to
                then = exc if isinstance(exc, ScenarioFailure) else f"{type(exc).__name__}: {exc}"
                raise ScenarioFailure(f"{named}; then {then}") from exc
            raise
        else:
            self.expect_no_violations(pair)
        finally:
            self._open_pairs.remove(pair)
            pair.close()

    def progress(self, line: str) -> None:
        """Say on stderr what a long wait waits for (the run is not hung)."""
        print(f"kvx conformance {self.name}: {line}", file=sys.stderr, flush=True)

    def run_until_finished(self, pair: DisaggregatedPair) -> None:
        """Step `pair` until every request ended; a stall fails with what is stuck."""
        pair.run_until_finished(
            timeout_s=self.fault_timeout_s * 3,
            stall_s=self.options.stall_timeout_s,
            progress=self.progress,
        )

    def run_engine(
        self, engine: Engine, prompts: dict[str, list[int]], max_tokens: int
    ) -> dict[str, list[int]]:
        """`run_engine` bounded by this run's stall limit, saying what it waits for."""
        return run_engine(
            engine,
            prompts,
            max_tokens,
            timeout_s=self.fault_timeout_s * 3,
            stall_s=self.options.stall_timeout_s,
            progress=self.progress,
        )

    def store_then_reuse(
        self, prompts: dict[str, list[int]], max_tokens: int, **engine: Any
    ) -> None:
        """One kv_both engine runs `prompts`, a fresh one runs them again: the fresh one must
        load some of their KV and both must give a single engine's tokens (`engine` overrides
        engine fields, e.g. `sliding_window`)."""
        expected = self.baseline(prompts, max_tokens, **engine)
        with self.engine("kv_both", **engine) as first_engine:
            first = self.run_engine(first_engine, prompts, max_tokens)
        with self.engine("kv_both", **engine) as fresh:
            again = self.run_engine(fresh, prompts, max_tokens)
            check(
                fresh.stats()["external_tokens"] > 0,
                "a fresh engine loaded nothing of prompts another engine had run",
            )
        check(first == expected, f"outputs of the storing engine differ: {first} != {expected}")
        check(again == expected, f"outputs of the loading engine differ: {again} != {expected}")

    def offload_then_reload(
        self,
        target: dict[str, list[int]],
        fillers: dict[str, list[int]],
        num_blocks: int,
        filler_tokens: int = 8,
        **engine: Any,
    ) -> dict[str, int]:
        """One kv_both engine of `num_blocks` runs `target` (4 tokens each), then `fillers`
        (`filler_tokens` each), which push the targets' blocks out of it; `target` run again
        must load some KV back from the offload tier, and every output must be a single
        engine's. Returns the engine's stats at the end (for a scenario's own checks)."""
        expected = self.baseline(target, 4, **engine) | self.baseline(
            fillers, filler_tokens, **engine
        )
        with self.engine("kv_both", num_blocks=num_blocks, **engine) as running:
            got = self.run_engine(running, target, 4)
            got |= self.run_engine(running, fillers, filler_tokens)
            before = running.stats()["external_tokens"]
            got |= self.run_engine(running, {f"{rid}-again": p for rid, p in target.items()}, 4)
            stats = running.stats()
            check(
                stats["external_tokens"] > before,
                "nothing was loaded back from the offload tier for prompts it stored",
            )
        expected |= {f"{rid}-again": expected[rid] for rid in target}  # both runs compared
        check(got == expected, f"outputs differ from a single engine's: {got} != {expected}")
        return stats

    def wait_for_fault_handling(
        self, pair: DisaggregatedPair, what: str, done: Callable[[], bool] | None = None
    ) -> None:
        """Step `pair` until `done()` (default: every request ended) while the connector deals
        with a fault (an abort, a dead peer, a lease running out). It must keep making
        progress: `stall_timeout_s` plus the longest wait the connector class declares
        (`fault_wait_s`, e.g. NIXL's lease) without any fails with what is held and which
        report is missing; `fault_timeout_s` (at least twice the declared wait) bounds the
        whole wait."""
        pair.run_until(
            done or pair.finished,
            what,
            timeout_s=self.fault_timeout_s,
            stall_s=self.fault_stall_s,
            progress=self.progress,
        )

    def describe(self) -> str:
        """What every open engine holds and waits for (for a scenario out of time)."""
        parts = [pair.describe_unfinished() for pair in self._open_pairs]
        for engine in self._open_engines:
            lines = engine.diagnose()
            parts.append(f"{engine.config.engine_id}: {'; '.join(lines) or 'idle'}")
        return "\n  ".join(parts)

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
        loaded_before = pair.decode.last_stats.get("external_tokens", 0)
        report = pair.run(
            prompts,
            max_tokens,
            timeout_s=self.fault_timeout_s * 3,
            stall_s=self.options.stall_timeout_s,
            progress=self.progress,
        )
        self.expect_no_violations(pair)
        self.expect_identical(report)
        self.expect_drained(pair)
        longest = max(map(len, prompts.values()), default=0)
        if self.via_store and longest >= STORE_PD_PROOF_TOKENS:
            loaded = report.decode_stats.get("external_tokens", 0) - loaded_before
            check(
                loaded > 0,
                f"P/D through the store: D loaded nothing for prompts of up to {longest} tokens "
                "P had just run (P kv_producer must have saved a prompt's KV by the time "
                "request_finished returns: a save after it, or one that never lands, is "
                "not found by D)",
            )
        return report

    @staticmethod
    def expect_loaded(report: DisaggReport) -> None:
        """D loaded some KV: a scenario about loads fails when nothing moved."""
        check(
            report.decode_stats["external_tokens"] > 0,
            f"D loaded nothing ({report.decode_stats}); the scenario needs a load",
        )

    @staticmethod
    def expect_no_violations(pair: DisaggregatedPair) -> None:
        check(not pair.violations, _violated(pair.violations))

    @staticmethod
    def expect_identical(report: DisaggReport) -> None:
        check(
            not report.kv_mismatches,
            f"KV bytes differ from what the prefill engine computed: {report.kv_mismatches[:3]}",
        )
        load_errors = report.decode_stats.get("load_errors", 0)
        for r in report.results.values():
            cause = (
                f" (D counted {load_errors} failed load(s): the connector reported this "
                "request's blocks bad; its log says why)"
                if r.status == "finished_error" and load_errors
                else ""
            )
            check(
                r.status == "finished_length_capped",
                f"request {r.request_id} ended as {r.status!r}, expected "
                f"finished_length_capped{cause}",
            )
            check(
                r.tokens == r.baseline,
                f"request {r.request_id} (prompt {r.prompt_len} tokens): decode's tokens "
                f"{r.tokens} differ from a single engine's {r.baseline}: the loaded KV is wrong",
            )

    @staticmethod
    def expect_drained(pair: DisaggregatedPair) -> None:
        """Both engines hold nothing: every block back in the free pool."""
        Harness.expect_no_violations(pair)
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


def run_engine(
    engine: Engine,
    prompts: dict[str, list[int]],
    max_tokens: int,
    timeout_s: float = 60.0,
    stall_s: float | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, list[int]]:
    """Step `engine` until `prompts` finish, checking every KV byte and the contract after
    every step. Bounded in time, not steps (a step that only waits for a connector's
    asynchronous copies does nothing); `stall_s` without output or any change in the engine's
    counters fails with what each request holds and waits for."""
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, max_tokens)
    done: dict[str, list[int]] = {}

    def step() -> bool:
        outputs = engine.step()
        for out in outputs:
            if out.finished:
                done[out.request_id] = out.output_token_ids
        mismatches = engine.check_kv()
        check(not mismatches, f"KV bytes differ after loading: {mismatches[:3]}")
        violations = engine.take_violations()
        check(not violations, _violated(violations))
        return bool(outputs)

    def state() -> tuple[tuple[str, int], ...]:
        return tuple(sorted((k, v) for k, v in engine.stats().items() if k != "steps"))

    def describe() -> str:
        return f"{'; '.join(engine.diagnose()) or 'idle'} ({engine.stats()})"

    wait_until(
        lambda: not engine.has_pending_work(),
        step,
        state,
        f"{engine.config.engine_id} finished {len(prompts)} request(s)",
        describe,
        timeout_s=timeout_s,
        stall_s=stall_s,
        progress=progress,
    )
    return done


def _violated(violations: list[str]) -> str:
    more = f" (and {len(violations) - 3} more)" if len(violations) > 3 else ""
    return "contract violated (docs/contract.md): " + "; ".join(violations[:3]) + more
