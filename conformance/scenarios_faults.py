"""Aborts at every stage and real process deaths: nothing hangs, nothing leaks, policy holds."""

from __future__ import annotations

from collections.abc import Callable

from kvx import Capability
from kvx.conformance.harness import STORE_PD_PROOF_TOKENS, Harness
from kvx.conformance.scenario import PD_EITHER, check, scenario
from kvx.engine.disagg import DisaggregatedPair

ASYNC = (Capability.ASYNC_LOAD,)
HANDOFF_ASYNC = (Capability.REMOTE_PREFILL, Capability.ASYNC_LOAD)


def _step_until(
    h: Harness, pair: DisaggregatedPair, condition: str, predicate: Callable[[], bool]
) -> None:
    """Step until the scenario's fault can be injected (30 s at most, and no stall)."""
    pair.run_until(
        predicate, condition, timeout_s=30.0, stall_s=h.options.stall_timeout_s, progress=h.progress
    )


@scenario(
    "abort_on_prefill", "P aborts a request mid-prefill: no params, nothing held", any_of=PD_EITHER
)
def abort_on_prefill(h: Harness) -> None:
    with h.pair(max_num_batched_tokens=16) as pair:
        pair.submit("victim", h.prompts([120])["req-0"], 4)
        pair.step()
        pair.prefill.abort_request("victim")
        h.wait_for_fault_handling(pair, "the aborted request ended and P freed its blocks")
        result = pair.results["victim"]
        check(
            result.status == "prefill finished_aborted",
            f"aborted request ended as {result.status!r}",
        )
        check(
            result.kv_transfer_params is None,
            f"an aborted prefill returned kv_transfer_params {result.kv_transfer_params}",
        )
        h.expect_drained(pair)


@scenario(
    "abort_on_decode_while_loading",
    "D aborts while the KV is loading: blocks held until the load ends, then freed",
    ASYNC,
    any_of=PD_EITHER,
)
def abort_on_decode_while_loading(h: Harness) -> None:
    with h.pair() as pair:
        pair.submit("victim", h.prompts([90])["req-0"], 4)
        _step_until(
            h, pair, "the request reached D", lambda: pair.results["victim"].status == "decoding"
        )
        pair.decode.abort_request("victim")
        h.wait_for_fault_handling(pair, "the load ended and both engines freed their blocks")
        check(
            pair.results["victim"].status == "finished_aborted",
            f"aborted request ended as {pair.results['victim'].status!r}",
        )
        h.expect_drained(pair)


@scenario(
    "abort_on_decode_while_decoding", "D aborts during decode: everything freed", any_of=PD_EITHER
)
def abort_on_decode_while_decoding(h: Harness) -> None:
    with h.pair() as pair:
        pair.submit("victim", h.prompts([30])["req-0"], 50)
        pair.submit(
            "other",
            h.prompts([30], seed=2)["req-0"],
            3,
            h.baseline({"o": h.prompts([30], seed=2)["req-0"]}, 3)["o"],
        )
        _step_until(
            h,
            pair,
            "the victim decoded a few tokens",
            lambda: len(pair.results["victim"].tokens) >= 3,
        )
        pair.decode.abort_request("victim")
        h.wait_for_fault_handling(pair, "every request ended and both engines freed their blocks")
        check(
            pair.results["other"].tokens == pair.results["other"].baseline,
            "a request next to an aborted one produced wrong tokens",
        )
        h.expect_drained(pair)


@scenario(
    "abort_between_prefill_and_decode",
    "the proxy never forwards P's params to D: P still frees its blocks in bounded time",
    any_of=PD_EITHER,
    timeout_s=180,
)
def abort_between_prefill_and_decode(h: Harness) -> None:
    with h.pair() as pair:
        pair.prefill.add_request("orphan", h.prompts([50])["req-0"], 1, {"do_remote_decode": True})
        h.wait_for_fault_handling(
            pair,
            "P freed the blocks of a request nobody will read (a lease or timeout must)",
            lambda: bool(pair.prefill.last_stats) and pair.finished(),  # P stepped at least once
        )
        check(
            pair.prefill.last_stats.get("held_blocks") == 0,
            f"P still holds blocks after a request nobody will read ({pair.prefill.last_stats})",
        )


def _prefill_killed(h: Harness, policy: str) -> tuple[str, list[int], list[int]]:
    prompt = h.prompts([70], seed=9)["req-0"]
    baseline = h.baseline({"r": prompt}, 5)["r"]
    with h.pair(processes=True, policy=policy) as pair:
        pair.submit("r", prompt, 5, baseline)
        _step_until(h, pair, "P returned params", lambda: pair.results["r"].status == "decoding")
        pair.kill("prefill")
        h.wait_for_fault_handling(
            pair, "D ended the request after P died", lambda: pair.results["r"].status != "decoding"
        )
        _expect_kv_intact(pair, policy)
        return pair.results["r"].status, pair.results["r"].tokens, baseline


def _expect_kv_intact(pair: DisaggregatedPair, policy: str) -> None:
    """D's KV, checked after every step, is what the model wrote: a wrong output after a
    fault names the first wrong position and its likely cause, not only the tokens."""
    check(
        not pair.kv_mismatches,
        f"policy {policy}: after P died, D's KV bytes differ from what the model wrote "
        f"({pair.decode.last_stats.get('load_errors', 0)} failed load(s) counted): "
        f"{pair.kv_mismatches[:3]}",
    )


@scenario(
    "prefill_killed_recompute",
    "P dies after request_finished: D reports load errors and recomputes (exact output)",
    HANDOFF_ASYNC,
    timeout_s=240,
)
def prefill_killed_recompute(h: Harness) -> None:
    status, tokens, baseline = _prefill_killed(h, "recompute")
    check(status == "finished_length_capped", f"request ended as {status!r}")
    check(tokens == baseline, f"recomputed output {tokens} differs from {baseline}")


@scenario(
    "prefill_killed_fail",
    "P dies after request_finished: with policy fail D ends the request with an error",
    HANDOFF_ASYNC,
    timeout_s=240,
)
def prefill_killed_fail(h: Harness) -> None:
    status, _, _ = _prefill_killed(h, "fail")
    check(status == "finished_error", f"request ended as {status!r}, expected finished_error")


@scenario(
    "decode_killed",
    "D dies before reading: P frees its blocks in bounded time",
    any_of=PD_EITHER,
    timeout_s=240,
)
def decode_killed(h: Harness) -> None:
    with h.pair(processes=True) as pair:
        pair.submit("r", h.prompts([70], seed=9)["req-0"], 5)
        _step_until(h, pair, "P returned params", lambda: pair.results["r"].status == "decoding")
        pair.kill("decode")
        h.wait_for_fault_handling(pair, "P freed its blocks after D died (a lease must)")


@scenario(
    "store_pd_prefill_killed",
    "P/D through a store: P dies right after its request finished; with either load-failure "
    "policy D loads what P stored (the store outlives P) and its output is exact",
    (Capability.STORE_PD,),
    timeout_s=240,
)
def store_pd_prefill_killed(h: Harness) -> None:
    for i, policy in enumerate(("recompute", "fail")):
        prompt = h.prompts([STORE_PD_PROOF_TOKENS + 20], seed=90 + i)["req-0"]
        baseline = h.baseline({"r": prompt}, 5)["r"]
        with h.pair(processes=True, policy=policy) as pair:
            pair.submit("r", prompt, 5, baseline)
            _step_until(h, pair, "P finished", lambda: pair.results["r"].status == "decoding")
            pair.kill("prefill")
            h.wait_for_fault_handling(
                pair,
                "D ended the request after P died",
                lambda: pair.results["r"].status != "decoding",
            )
            _expect_kv_intact(pair, policy)
            result = pair.results["r"]
            check(
                (result.status, result.tokens) == ("finished_length_capped", baseline),
                f"policy {policy}: after P died D ended the request as {result.status!r} with "
                f"tokens {result.tokens} (a single engine's: {baseline})",
            )
            check(
                pair.decode.last_stats.get("external_tokens", 0) > 0,
                f"policy {policy}: D loaded nothing of a {len(prompt)}-token prompt P had "
                "stored before it died: what P stored must outlive P's process",
            )
