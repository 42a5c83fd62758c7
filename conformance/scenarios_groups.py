"""Two KV-cache groups (`kvx.SupportsHMA`, vLLM's hybrid allocator), as Gemma-3: the reference
engine's `kv_groups=2` gives even layers full attention (group 0) and odd layers a sliding
window (group 1), each group its own block table per request, group 1's leading entries
`kvx.NULL_BLOCK` once outside its window.

A connector must move each group's layers through that group's table: the engine's groups never
share a block id, and each layer's blocks of the other group, like the null block, are filled
with a pattern `check_kv` fails a scenario for changing. Every KV element of both groups is
compared after every step, and the tokens equal a single engine's with the same groups.
"""

from __future__ import annotations

from typing import Any

from kvx import Capability
from kvx.conformance.harness import Harness
from kvx.conformance.scenario import PD_EITHER, scenario

BOTH = "kv_both on every engine"
# two 16-token blocks of window; layer 0 full attention, layer 1 the window
GROUPS: dict[str, Any] = {"kv_groups": 2, "sliding_window": 32}


@scenario(
    "groups_pd",
    "two KV-cache groups P/D: D loads the full-attention group's blocks and the window "
    "group's last ones, each through its own table",
    (Capability.HMA,),
    any_of=PD_EITHER,
    group="pd",
)
def groups_pd(h: Harness) -> None:
    with h.pair(**GROUPS) as pair:
        report = h.run_pair(pair, h.prompts([100, 75, 320, 48], seed=71))
        h.expect_loaded(report)


@scenario(
    "groups_store_reuse",
    "two KV-cache groups: a fresh engine reuses stored KV of both groups, prompts longer "
    "than the window group's window",
    (Capability.STORE_REUSE, Capability.HMA),
    roles=BOTH,
    group="contract",
)
def groups_store_reuse(h: Harness) -> None:
    prompts = h.prompts([100, 75, 130, 48], seed=72)
    h.store_then_reuse(prompts, 4, **GROUPS)


@scenario(
    "groups_offload",
    "two KV-cache groups: KV offloaded from an engine is loaded back into each group's "
    "blocks, the window group's NULL_BLOCK entries skipped",
    (Capability.OFFLOAD, Capability.HMA),
    roles=BOTH,
    group="contract",
)
def groups_offload(h: Harness) -> None:
    target = h.prompts([120, 70], seed=73)
    fillers = h.prompts([100, 90, 110, 95], seed=74, name="filler")
    # 20 blocks per group: the fillers push the targets' blocks out of the engine
    h.offload_then_reload(target, fillers, num_blocks=41, **GROUPS)
