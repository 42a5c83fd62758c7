"""Pipeline parallelism: which layers a PP stage holds, and reads between engines whose PP
sizes differ.

A connector on a PP stage handles only that stage's layers. Both sides name layers the same
way (the model's attention layer names), so a reader maps each of its layers to the remote
stage that holds the same name; reads and "done" counts are per `(pp_rank, tp_rank)`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvx.topology.errors import TopologyError
from kvx.topology.plan import KVGeometry, TransferPlan, plan_reads


class RankRef(NamedTuple):
    """One worker of an engine: its pipeline stage and tensor-parallel rank."""

    pp_rank: int
    tp_rank: int


def pp_layer_range(
    num_layers: int, pp_rank: int, pp_size: int, partition: Sequence[int] | None = None
) -> range:
    """Layer indices of stage `pp_rank` (matches vLLM's `get_pp_indices`).

    `partition` gives each stage's layer count explicitly (vLLM's `VLLM_PP_LAYER_PARTITION`).
    Otherwise layers split evenly and any remainder goes one each to the stages before the
    last, starting from the second-to-last (the last stage also holds the output head).
    """
    if not 0 <= pp_rank < pp_size:
        raise TopologyError(f"pp_rank must be in [0, {pp_size}), got {pp_rank!r}")
    if partition is not None:
        counts = list(partition)
        if len(counts) != pp_size or sum(counts) != num_layers or min(counts) < 0:
            raise TopologyError(
                f"partition {counts} must have pp_size={pp_size} non-negative entries "
                f"summing to num_layers={num_layers}"
            )
    else:
        if num_layers < pp_size:
            raise TopologyError(
                f"num_layers={num_layers} is smaller than pp_size={pp_size}; every stage "
                "needs a layer (or pass an explicit partition)"
            )
        counts = [num_layers // pp_size] * pp_size
        for i in range(2, num_layers % pp_size + 2):
            counts[-i] += 1
    start = sum(counts[:pp_rank])
    return range(start, start + counts[pp_rank])


def extract_layer_index(layer_name: str) -> int:
    """The layer index in a name such as `model.layers.3.self_attn.attn` (the one dotted
    component that is an integer), as vLLM's `extract_layer_index`."""
    numbers = [int(part) for part in layer_name.split(".") if part.isdigit()]
    if len(numbers) != 1:
        raise TopologyError(
            f"layer name {layer_name!r} must contain exactly one integer component "
            f"(like 'model.layers.3.self_attn.attn'), found {numbers}"
        )
    return numbers[0]


def stage_layer_names(
    layer_names: Sequence[str],
    pp_rank: int,
    pp_size: int,
    partition: Sequence[int] | None = None,
) -> list[str]:
    """The names among `layer_names` (every layer of the model) that stage `pp_rank` holds."""
    indices = {extract_layer_index(n) for n in layer_names}
    span = pp_layer_range(len(indices), pp_rank, pp_size, partition)
    return [n for n in layer_names if extract_layer_index(n) in span]


def layer_sources(
    local_layers: Sequence[str], remote_stage_layers: Mapping[int, Sequence[str]]
) -> dict[str, int]:
    """For each local layer name, the remote PP rank holding a layer of the same name.

    `remote_stage_layers` maps each remote PP rank to its layer names (as each stage reports
    them in the handshake)."""
    owner: dict[str, int] = {}
    for pp_rank, names in remote_stage_layers.items():
        for name in names:
            if name in owner:
                raise TopologyError(
                    f"remote layer {name!r} is reported by PP ranks {owner[name]} and {pp_rank}; "
                    "each layer must live on exactly one stage"
                )
            owner[name] = pp_rank
    missing = [n for n in local_layers if n not in owner]
    if missing:
        raise TopologyError(
            f"local layers {missing} are held by no remote PP stage; both engines must run the "
            f"same model (remote layers: {sorted(owner)[:8]}{'...' if len(owner) > 8 else ''})"
        )
    return {n: owner[n] for n in local_layers}


@dataclass(frozen=True)
class StagePlan:
    """What one local worker `(pp_rank, tp_rank)` reads: the head/block plan (the same for
    every layer) and, per remote PP rank, which of its own layers come from there."""

    local_rank: RankRef
    plan: TransferPlan
    layers_by_stage: Mapping[int, tuple[str, ...]]

    @property
    def targets(self) -> list[RankRef]:
        """Every remote worker read, in (stage, TP rank) order."""
        return [
            RankRef(pp, tp) for pp in sorted(self.layers_by_stage) for tp in self.plan.remote_ranks
        ]


def plan_stage_reads(
    local: KVGeometry,
    remote: KVGeometry,
    local_rank: RankRef,
    local_layers: Sequence[str],
    remote_stage_layers: Mapping[int, Sequence[str]],
) -> StagePlan:
    """The reads of local worker `local_rank`, whose stage holds `local_layers`."""
    if not 0 <= local_rank.pp_rank < local.pp_size:
        raise TopologyError(
            f"local pp_rank {local_rank.pp_rank} out of range for pp_size={local.pp_size}"
        )
    bad = [p for p in remote_stage_layers if not 0 <= p < remote.pp_size]
    if bad:
        raise TopologyError(f"remote PP ranks {bad} out of range for pp_size={remote.pp_size}")
    sources = layer_sources(local_layers, remote_stage_layers)
    by_stage: dict[int, list[str]] = {}
    for name in local_layers:
        by_stage.setdefault(sources[name], []).append(name)
    return StagePlan(
        local_rank=local_rank,
        plan=plan_reads(local, remote, local_rank.tp_rank),
        layers_by_stage={pp: tuple(names) for pp, names in sorted(by_stage.items())},
    )


def readers_per_remote_worker(
    producer: KVGeometry,
    consumer: KVGeometry,
    producer_stage_layers: Mapping[int, Sequence[str]],
    consumer_stage_layers: Mapping[int, Sequence[str]],
) -> dict[RankRef, int]:
    """For each producer worker `(pp_rank, tp_rank)`, how many consumer workers read from it:
    the "done" notifications it waits for. 0 means nobody reads it (its heads are replicated
    and read elsewhere): it must not wait, see `readers_per_remote_rank`."""
    counts = {
        RankRef(pp, tp): 0 for pp in range(producer.pp_size) for tp in range(producer.tp_size)
    }
    for pp in range(consumer.pp_size):
        layers = consumer_stage_layers.get(pp, ())
        for tp in range(consumer.tp_size):
            where = RankRef(pp, tp)
            stage = plan_stage_reads(consumer, producer, where, layers, producer_stage_layers)
            for target in stage.targets:
                counts[target] += 1
    return counts
