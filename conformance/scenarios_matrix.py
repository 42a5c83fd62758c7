"""The matrix: every KV dtype, block sizes, and prompts from one token to well beyond 64
blocks, through whichever transfer the connector claims; every cell checks every KV byte.
`SuiteOptions.dtypes` / `block_sizes` (`--dtype`, `--block-size`) narrow it."""

from __future__ import annotations

from typing import Any

from kvx import Capability
from kvx.conformance.harness import STORE_PD_PROOF_TOKENS, Harness
from kvx.conformance.scenario import check, scenario
from kvx.conformance.scenarios_contract import store_then_load

LONG_BLOCKS = 70  # a prompt beyond 64 blocks: past any fixed staging size of 64 blocks


def cell_prompts(h: Harness, block_size: int, seed: int) -> dict[str, list[int]]:
    """1 token, around one block, several blocks, and one long prompt: at the smallest block
    size 70 blocks and a partial one, at the others a whole chunk of every store's documented
    default (LMCache: 256 tokens) and a partial one."""
    lengths = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5]
    if block_size == min(h.options.block_sizes):
        lengths.append(LONG_BLOCKS * block_size + 5)
    else:
        lengths.append(STORE_PD_PROOF_TOKENS)
    return h.prompts(lengths, seed=seed, name=f"bs{block_size}")


@scenario(
    "matrix",
    "each KV dtype (float32, float16, bfloat16) x block size (16, 32), prompts of 1 token to 70 "
    "blocks: P/D (hand-off or through the store) or store then reuse; every byte checked",
    timeout_s=900,
    any_of=(Capability.REMOTE_PREFILL, Capability.STORE_PD, Capability.STORE_REUSE),
    roles="P kv_producer, D kv_consumer (store_reuse alone: kv_both, one engine then another)",
)
def matrix(h: Harness) -> None:
    pd = bool(h.claims & {Capability.REMOTE_PREFILL, Capability.STORE_PD})
    for i, dtype in enumerate(h.options.dtypes):
        for j, size in enumerate(h.options.block_sizes):
            prompts = cell_prompts(h, size, seed=700 + 10 * i + j)
            cell: dict[str, Any] = {"dtype": dtype, "block_size": size, "num_blocks": 256}
            where = f"cell dtype {dtype}, block size {size}"
            try:
                if pd:
                    with h.pair(**cell) as pair:
                        h.run_pair(pair, prompts, max_tokens=3)
                else:
                    store_then_load(h, prompts, store=cell, load=cell)
            except Exception as exc:  # say which cell failed, and how
                detail = str(exc) if isinstance(exc, AssertionError) else repr(exc)
                check(False, f"{where}: {detail}")
