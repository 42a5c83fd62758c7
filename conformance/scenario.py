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
TRANSFER_CLAIMS = frozenset(
    {Capability.REMOTE_PREFILL, Capability.STORE_REUSE, Capability.STORE_PD, Capability.OFFLOAD}
)
# P/D scenarios run for a hand-off (P's params tell D where to read) and for P/D through a store
# (P saves, D finds the prefix in the store): either claim.
PD_EITHER = frozenset({Capability.REMOTE_PREFILL, Capability.STORE_PD})

PD_ROLES = "P kv_producer, D kv_consumer"


@dataclass(frozen=True)
class Scenario:
    """One behaviour the suite checks. `requires` are the capabilities it needs claimed;
    `timeout_s` bounds it (a hang is a failure, never a stuck suite); `group` is the kit class
    that holds it (`pd`, `faults`, `contract`, `roles`, or a new module's suffix); `roles` says
    which `kv_role` it gives each engine; `any_of`, when not empty, needs one of its claims
    besides all of `requires`."""

    name: str
    summary: str
    run: Callable[[Harness], None]
    requires: frozenset[Capability] = field(default_factory=frozenset)
    timeout_s: float = 120.0
    group: str = "contract"
    roles: str = PD_ROLES
    any_of: frozenset[Capability] = field(default_factory=frozenset)

    @property
    def transfers(self) -> bool:
        """Whether the scenario moves KV (a P/D hand-off, a store or an offload)."""
        return bool((self.requires | self.any_of) & TRANSFER_CLAIMS)

    def missing_claims(self, claims: frozenset[Capability]) -> list[str]:
        missing = sorted(c.value for c in self.requires - claims)
        if self.any_of and not self.any_of & claims:
            missing.append("one of " + " or ".join(sorted(c.value for c in self.any_of)))
        return missing


SCENARIOS: dict[str, Scenario] = {}


def scenario(
    name: str,
    summary: str,
    requires: tuple[Capability, ...] = (),
    timeout_s: float = 120.0,
    roles: str = PD_ROLES,
    any_of: frozenset[Capability] | tuple[Capability, ...] = (),
    group: str | None = None,
) -> Callable[[Callable[[Harness], None]], Callable[[Harness], None]]:
    """Register a scenario function under `name`; its group is `group`, by default its
    module's suffix (`scenarios_pd` -> `pd`). It runs when every claim of `requires` and (if
    given) one of `any_of` is claimed (`PD_EITHER`: a P/D hand-off or P/D through a store)."""

    def register(func: Callable[[Harness], None]) -> Callable[[Harness], None]:
        if name in SCENARIOS:
            raise ValueError(f"scenario {name!r} is defined twice")
        kit = group or func.__module__.rpartition(".")[2].removeprefix("scenarios_")
        SCENARIOS[name] = Scenario(
            name, summary, func, frozenset(requires), timeout_s, kit, roles, frozenset(any_of)
        )
        return func

    return register


def check(condition: bool, message: str) -> None:
    """Fail the scenario with `message` unless `condition` holds."""
    if not condition:
        raise ScenarioFailure(message)
