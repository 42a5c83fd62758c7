"""MLA scenarios: the reference engine's MLA model (`EngineConfig.use_mla`: one latent vector per
token, no heads dim, the same on every TP rank) moved P/D, between TP sizes, through storage and
through an offload tier; every KV byte checked after every step."""

from __future__ import annotations

from typing import Any

from kvx import Capability
from kvx.conformance.harness import Harness
from kvx.conformance.scenario import check, scenario

BOTH = "kv_both on every engine"
MLA: dict[str, Any] = {"use_mla": True}


@scenario(
    "mla_pd",
    "an MLA model's latent moves P/D, partial last blocks included",
    (Capability.REMOTE_PREFILL, Capability.MLA),
)
def mla_pd(h: Harness) -> None:
    with h.pair(**MLA) as pair:
        h.run_pair(pair, h.prompts([5, 16, 37, 64], seed=500))


@scenario(
    "mla_pd_hetero_tp",
    "an MLA model P/D between TP sizes 2:1, 1:2 and 4:2: any D rank reads the one latent",
    (Capability.REMOTE_PREFILL, Capability.HETERO_TP, Capability.MLA),
    timeout_s=300,
)
def mla_pd_hetero_tp(h: Harness) -> None:
    for i, tp in enumerate(((2, 1), (1, 2), (4, 2))):
        with h.pair(tp=tp, **MLA) as pair:
            h.run_pair(pair, h.prompts([19, 48], seed=510 + i))


@scenario(
    "mla_stored_hetero_tp",
    "an MLA model's latent stored at TP 2 loads at TP 1 and the other way",
    (Capability.STORE_REUSE, Capability.HETERO_TP, Capability.MLA),
    timeout_s=300,
    roles=BOTH,
)
def mla_stored_hetero_tp(h: Harness) -> None:
    for i, (store, load) in enumerate(((2, 1), (1, 2))):
        prompts = h.prompts([37, 64], seed=520 + i)  # fresh prompts: each case its own store
        expected = h.baseline(prompts, 4, **MLA)
        where = f"stored at TP {store}, loaded at TP {load}"
        with h.engine("kv_both", tp_size=store, **MLA) as first:
            check(h.run_engine(first, prompts, 4) == expected, f"{where}: storing engine differs")
        with h.engine("kv_both", tp_size=load, **MLA) as second:
            got = h.run_engine(second, prompts, 4)  # checks every KV byte after every step
            check(got == expected, f"{where}: outputs after loading differ: {got} != {expected}")
            check(second.stats()["external_tokens"] > 0, f"{where}: nothing was loaded")


@scenario(
    "mla_offload_and_reload",
    "an MLA model's latent evicted from the engine is loaded back from the slower tier",
    (Capability.OFFLOAD, Capability.MLA),
    roles=BOTH,
)
def mla_offload_and_reload(h: Harness) -> None:
    target = h.prompts([120, 70], seed=530)
    fillers = h.prompts([100, 90, 110, 95], seed=531, name="filler")
    h.offload_then_reload(
        target, fillers, num_blocks=24, filler_tokens=40, max_num_batched_tokens=128, **MLA
    )
