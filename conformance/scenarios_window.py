"""Sliding-window scenarios: attention reads only the last `WINDOW` tokens, so the engine frees
a request's leading blocks and its table says `kvx.NULL_BLOCK` there (vLLM's null block).

A connector must never read or write through a null entry: the reference engine keeps its last
block as the null block, filled with a pattern no request owns, and `check_kv` fails a scenario
whose null block changed (a write through index -1 lands there). Loads and stores cover only
the window's blocks, and the tokens equal a single engine's with the same window.
"""

from __future__ import annotations

from kvx import Capability
from kvx.conformance.harness import STORE_PD_PROOF_TOKENS, Harness
from kvx.conformance.scenario import check, scenario

WINDOW = 32  # tokens: two 16-token blocks of the suite's engines
BOTH = "kv_both on every engine"


@scenario(
    "window_pd",
    "sliding window: D loads only the window's blocks, never through a NULL_BLOCK entry",
    (Capability.REMOTE_PREFILL,),
    group="pd",
)
def window_pd(h: Harness) -> None:
    with h.pair(sliding_window=WINDOW) as pair:
        report = h.run_pair(pair, h.prompts([100, 75, 130, 48], seed=61))
        h.expect_loaded(report)


@scenario(
    "window_store_reuse",
    "sliding window: a fresh engine reuses stored KV of prompts longer than the window",
    (Capability.STORE_REUSE,),
    roles=BOTH,
    group="contract",
)
def window_store_reuse(h: Harness) -> None:
    # the longest spans a whole chunk of every store's documented default (LMCache: 256)
    prompts = h.prompts([100, 75, 130, 48, STORE_PD_PROOF_TOKENS], seed=62)
    h.store_then_reuse(prompts, 4, sliding_window=WINDOW)


@scenario(
    "window_offload",
    "sliding window: KV offloaded from an engine and loaded back skips NULL_BLOCK entries",
    (Capability.OFFLOAD,),
    roles=BOTH,
    group="contract",
)
def window_offload(h: Harness) -> None:
    target = h.prompts([120, 70], seed=63)
    fillers = h.prompts([100, 90, 110, 95], seed=64, name="filler")
    h.offload_then_reload(target, fillers, num_blocks=40, sliding_window=WINDOW)


@scenario(
    "window_pd_prefill_hit",
    "sliding window: P's save of a prompt whose leading blocks it had cached (null in its "
    "table) sends only the window's blocks",
    (Capability.REMOTE_PREFILL,),
    group="pd",
)
def window_pd_prefill_hit(h: Harness) -> None:
    prefix = h.prompts([96], seed=65, name="prefix")["prefix-0"]
    with h.pair(sliding_window=WINDOW) as pair:
        h.run_pair(pair, {"warm": prefix})
        before = pair.decode.last_stats.get("external_tokens", 0)
        # P hits the prefix; the blocks before its window come as NULL_BLOCK in P's table
        report = h.run_pair(pair, h.prompts([70, 45], seed=66, prefix=prefix))
        check(
            report.decode_stats["external_tokens"] > before,
            f"D loaded nothing of the second prompts ({report.decode_stats}); the scenario "
            "needs a load",
        )


@scenario(
    "window_pd_chunked_prefill",
    "sliding window: P prefills in chunks, its leading blocks freed (and reused by other "
    "requests) before the prompt is done; D still gets only the window's blocks, P's own",
    (Capability.REMOTE_PREFILL,),
    group="pd",
)
def window_pd_chunked_prefill(h: Harness) -> None:
    # a 24-token budget: each prompt's first blocks leave P's window while it still prefills,
    # and the engine does not tell the connector of a running request's freed blocks
    with h.pair(sliding_window=WINDOW, max_num_batched_tokens=24) as pair:
        report = h.run_pair(pair, h.prompts([100, 75, 130, 48], seed=67))
        h.expect_loaded(report)
