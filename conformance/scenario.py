"""What a conformance scenario is, and the list every runner (pytest, `kvx conformance`) uses."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvx import Capability

if TYPE_CHECKING:
    from kvx.conformance.harness import Harness


class ScenarioFailure(AssertionError):
    """A connector did not behave as the contract requires; the message says how."""


# Claims whose scenarios move KV between engines (or tiers): a run that ran none of them tested
# no transfer at all.
TRANSFER_CLAIMS = frozenset({Capability.REMOTE_PREFILL, Capability.STORE_REUSE, Capability.OFFLOAD})

PD_ROLES = "P kv_producer, D kv_consumer"


@dataclass(frozen=True)
class Scenario:
    """One behaviour the suite checks. `requires` are the capabilities it needs claimed;
    `timeout_s` bounds it (a hang is a failure, never a stuck suite); `group` is the kit class
    that holds it (`pd`, `faults`, `contract`, `roles`); `roles` says which `kv_role` it gives
    each engine."""

    name: str
    summary: str
    run: Callable[[Harness], None]
    requires: frozenset[Capability] = field(default_factory=frozenset)
    timeout_s: float = 120.0
    group: str = "contract"
    roles: str = PD_ROLES

    @property
    def transfers(self) -> bool:
        """Whether the scenario moves KV (a P/D hand-off, a store or an offload)."""
        return bool(self.requires & TRANSFER_CLAIMS)

    def missing_claims(self, claims: frozenset[Capability]) -> list[str]:
        return sorted(c.value for c in self.requires - claims)


SCENARIOS: dict[str, Scenario] = {}


def scenario(
    name: str,
    summary: str,
    requires: tuple[Capability, ...] = (),
    timeout_s: float = 120.0,
    roles: str = PD_ROLES,
    group: str | None = None,
) -> Callable[[Callable[[Harness], None]], Callable[[Harness], None]]:
    """Register a scenario function under `name`; its group is `group`, by default its
    module's suffix (`scenarios_pd` -> `pd`)."""

    def register(func: Callable[[Harness], None]) -> Callable[[Harness], None]:
        if name in SCENARIOS:
            raise ValueError(f"scenario {name!r} is defined twice")
        kit = group or func.__module__.rpartition(".")[2].removeprefix("scenarios_")
        SCENARIOS[name] = Scenario(name, summary, func, frozenset(requires), timeout_s, kit, roles)
        return func

    return register


def check(condition: bool, message: str) -> None:
    """Fail the scenario with `message` unless `condition` holds."""
    if not condition:
        raise ScenarioFailure(message)
