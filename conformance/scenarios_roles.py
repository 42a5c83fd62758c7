"""What each `kv_role` obliges and forbids (docs/contract.md, "Roles").

P/D scenarios already run P as `kv_producer` and D as `kv_consumer`, and the reference engine
records a producer that offers tokens to load or a consumer that holds blocks to send. These
scenarios check the roles of a connector that stores KV for later reuse, where a role breach
shows only in what ends up stored or loaded.
"""

from __future__ import annotations

from kvx import Capability
from kvx.conformance.harness import Harness
from kvx.conformance.scenario import check, scenario

ROLES = "kv_producer, then kv_consumer, then kv_both probes the store"


@scenario(
    "roles_store_reuse",
    "kv_producer stores, kv_consumer loads it; a consumer stores nothing, a producer loads nothing",
    (Capability.STORE_REUSE,),
    roles=ROLES,
)
def roles_store_reuse(h: Harness) -> None:
    shared = h.prompts([300, 150, 40], seed=51, name="shared")  # 300: past a 256-token chunk
    own = h.prompts([70, 120], seed=52, name="own")
    expected = h.baseline(shared, 4)
    with h.engine("kv_producer") as producer:
        h.run_engine(producer, shared, 4)
    with h.engine("kv_consumer") as consumer:
        got = h.run_engine(consumer, shared, 4)
        check(
            consumer.stats()["external_tokens"] > 0,
            "role kv_consumer: a consumer loaded nothing of prompts a kv_producer had run "
            "(a producer must store, a consumer must load what is stored)",
        )
        check(got == expected, f"outputs of the consumer differ: {got} != {expected}")
    with h.engine("kv_consumer") as consumer:
        h.run_engine(consumer, own, 4)
    with h.engine("kv_both") as probe:
        h.run_engine(probe, own, 4)
        check(
            probe.stats()["external_tokens"] == 0,
            f"role kv_consumer: {probe.stats()['external_tokens']} tokens of prompts only a "
            "kv_consumer had run were found stored; a pure consumer never saves",
        )
    with h.engine("kv_producer") as producer:
        h.run_engine(producer, shared, 4)  # records a producer offering tokens to load
        check(
            producer.stats()["external_tokens"] == 0,
            "role kv_producer: a producer loaded stored KV; a pure producer never loads",
        )
