"""Prefill/decode lifecycle scenarios: remote decode / remote prefill, as vLLM's
`tests/v1/kv_connector/unit/` exercises them (see docs/conformance.md)."""

from __future__ import annotations

from kvx.conformance.harness import Harness
from kvx.conformance.scenario import PD_EITHER, check, scenario


@scenario(
    "pd_short_prompt",
    "a prompt shorter than one block still moves its partial block",
    any_of=PD_EITHER,
)
def pd_short_prompt(h: Harness) -> None:
    with h.pair() as pair:
        h.run_pair(pair, h.prompts([1, 5, 15]))


@scenario(
    "pd_block_multiple",
    "prompts of exactly 1, 2 and 4 blocks: last token recomputed",
    any_of=PD_EITHER,
)
def pd_block_multiple(h: Harness) -> None:
    with h.pair() as pair:
        h.run_pair(pair, h.prompts([16, 32, 64]))


@scenario("pd_long_prompts", "prompts of many blocks with a partial last block", any_of=PD_EITHER)
def pd_long_prompts(h: Harness) -> None:
    with h.pair(num_blocks=256) as pair:
        h.run_pair(pair, h.prompts([300, 417, 130]))


@scenario(
    "pd_chunked_prefill",
    "prefill in chunks under a small token budget on both sides",
    any_of=PD_EITHER,
)
def pd_chunked_prefill(h: Harness) -> None:
    with h.pair(max_num_batched_tokens=24) as pair:
        h.run_pair(pair, h.prompts([100, 61, 7, 48]))


@scenario(
    "pd_separate_processes", "P and D in separate OS processes, driven by a proxy", any_of=PD_EITHER
)
def pd_separate_processes(h: Harness) -> None:
    with h.pair(processes=True) as pair:
        h.run_pair(pair, h.prompts([9, 33, 80]))


@scenario(
    "pd_prefix_hit_on_prefill",
    "a prefix-cache hit on P still sends every block, partial last block included",
    any_of=PD_EITHER,
)
def pd_prefix_hit_on_prefill(h: Harness) -> None:
    shared = h.prompts([64], seed=7)["req-0"]
    with h.pair() as pair:
        h.run_pair(pair, {"first": [*shared, 1, 2, 3]})
        report = h.run_pair(pair, {"second": [*shared, 9, 8, 7, 6, 5]})
        check(
            report.prefill_stats["prefix_hit_tokens"] >= 64,
            f"P did not hit its prefix cache ({report.prefill_stats}); the scenario needs it",
        )


@scenario(
    "pd_prefix_hit_on_decode",
    "D already holds a prefix: it loads only the rest, output still exact",
    any_of=PD_EITHER,
)
def pd_prefix_hit_on_decode(h: Harness) -> None:
    shared = h.prompts([48], seed=11)["req-0"]
    with h.pair() as pair:
        first = {"local": [*shared, 4]}
        pair.submit_local("local", first["local"], 2, h.baseline(first, 2)["local"])
        h.run_until_finished(pair)
        # Two blocks and more past the shared prefix: a store loads them after D's local hit.
        report = h.run_pair(pair, {"remote": [*shared, *h.prompts([40], seed=12)["req-0"]]})
        check(
            report.decode_stats["prefix_hit_tokens"] >= 48,
            f"D did not hit its prefix cache ({report.decode_stats})",
        )
        check(
            not h.via_store or report.decode_stats["external_tokens"] > 0,
            "P/D through the store: D loaded nothing past its local prefix hit of 48 tokens "
            f"({report.decode_stats})",
        )


@scenario(
    "pd_interleaved_local",
    "remote-prefill requests mixed with D's local requests",
    any_of=PD_EITHER,
)
def pd_interleaved_local(h: Harness) -> None:
    local = h.prompts([20, 70], seed=3, name="local")
    remote = h.prompts([40, 12, 90], seed=4)
    local_base, remote_base = h.baseline(local, 5), h.baseline(remote, 5)
    with h.pair() as pair:
        for rid, prompt in local.items():
            pair.submit_local(rid, prompt, 5, local_base[rid])
        for rid, prompt in remote.items():
            pair.submit(rid, prompt, 5, remote_base[rid])
        h.run_until_finished(pair)
        h.expect_identical(pair.report())
        h.expect_drained(pair)


@scenario(
    "aggregation_tp_pp",
    "TP 2 x PP 2 on both sides: finished only when all 4 workers reported",
    any_of=PD_EITHER,
)
def aggregation_tp_pp(h: Harness) -> None:
    with h.pair(tp=(2, 2), pp_size=2) as pair:
        h.run_pair(pair, h.prompts([17, 50, 3]))


@scenario(
    "preemption_on_decode",
    "D runs out of blocks and preempts; outputs stay exact",
    any_of=PD_EITHER,
)
def preemption_on_decode(h: Harness) -> None:
    with h.pair(decode={"num_blocks": 14}) as pair:
        report = h.run_pair(pair, h.prompts([40, 41, 42, 43], seed=5), max_tokens=24)
        check(
            report.decode_stats["preemptions"] > 0,
            f"no preemption happened on D ({report.decode_stats}); the scenario needs one",
        )


@scenario(
    "concurrency_soak",
    "64 concurrent requests, 3 rounds, every byte checked",
    any_of=PD_EITHER,
    timeout_s=300,
)
def concurrency_soak(h: Harness) -> None:
    with h.pair(num_blocks=640, max_num_batched_tokens=1024) as pair:
        for round_ in range(3):
            prompts = h.prompts(
                [8 + (i * 37) % 90 for i in range(64)], seed=100 + round_, name=f"round{round_}"
            )
            h.run_pair(pair, prompts, max_tokens=4)


@scenario(
    "pd_prefill_block_pressure",
    "P has few blocks and new prompts keep arriving: P reuses freed blocks at once, so a send "
    "reported finished before its blocks were read delivers someone else's KV",
    any_of=PD_EITHER,
)
def pd_prefill_block_pressure(h: Harness) -> None:
    prompts = h.prompts([20 + (i * 13) % 40 for i in range(12)], seed=61, name="pressed")
    baseline = h.baseline(prompts, 3)
    # 8 blocks: two or three prompts' worth; D has plenty.
    with h.pair(prefill={"num_blocks": 8, "max_num_batched_tokens": 48}) as pair:
        queue = list(prompts.items())
        while queue:  # two new prompts per proxy round, while P is full of held blocks
            for rid, prompt in queue[:2]:
                pair.submit(rid, prompt, 3, baseline[rid])
            del queue[:2]
            pair.step()
        h.run_until_finished(pair)
        report = pair.report()
        h.expect_identical(report)
        h.expect_drained(pair)
        check(
            report.prefill_stats["min_free_blocks"] <= 2,
            f"P never ran short of blocks ({report.prefill_stats}); the scenario needs it",
        )
