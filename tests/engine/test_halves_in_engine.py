"""A `RoleSplitConnector`'s halves driven by the reference engine: every worker's handshake
metadata reaches the scheduler half keyed by (pp_rank, tp_rank) after the KV caches exist, and
the worker half's `wait_for_save` gets the step's metadata, the same object its loads got."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvx import (
    AgentPayload,
    ConnectorScheduler,
    ConnectorWorker,
    KVConnectorMetadata,
    KVConnectorRole,
    KVTransferConfig,
    ParallelInfo,
    RoleSplitConnector,
    WorkerAddress,
)
from kvx.engine import Engine, EngineConfig


@dataclass
class StepMeta(KVConnectorMetadata):
    step: int


class RecordingScheduler(ConnectorScheduler):
    handshake_type = AgentPayload

    def __init__(self, options: Any, config: KVTransferConfig, ctx: Any) -> None:
        self.steps = 0
        self.handshakes: list[dict[tuple[int, int], AgentPayload]] = []

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> StepMeta:
        self.steps += 1
        return StepMeta(self.steps)

    def set_handshake_metadata(self, metadata: dict[tuple[int, int], AgentPayload]) -> None:
        self.handshakes.append(dict(metadata))


class RecordingWorker(ConnectorWorker[StepMeta]):
    def __init__(self, options: Any, config: KVTransferConfig, ctx: Any) -> None:
        self.parallel = ctx.parallel
        self.layers: list[str] = []
        self.loads: list[StepMeta] = []
        self.saved: list[StepMeta] = []  # what save_kv_layer got
        self.waited: list[StepMeta] = []  # what wait_for_save got

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.layers = list(kv_caches)

    def get_handshake_metadata(self) -> AgentPayload:
        """Names this worker and the layers it registered (so it was asked after
        `register_kv_caches`)."""
        p = self.parallel
        return AgentPayload(f"{p.pp_rank}/{p.tp_rank}:{','.join(self.layers)}".encode())

    def start_load_kv(self, metadata: StepMeta) -> None:
        self.loads.append(metadata)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, metadata: StepMeta) -> None:
        self.saved.append(metadata)

    def wait_for_save(self, metadata: StepMeta) -> None:
        self.waited.append(metadata)


class HandshakeHalves(RoleSplitConnector[RecordingScheduler, RecordingWorker]):
    """Only delegation: both behaviours under test are the halves'."""


def engine(tp: int, pp: int) -> Engine:
    ktc = KVTransferConfig(
        kv_connector="HandshakeHalves", kv_connector_module_path=__name__, kv_role="kv_both"
    )
    return Engine(EngineConfig(num_layers=4, tp_size=tp, pp_size=pp, kv_transfer_config=ktc))


def test_every_workers_handshake_reaches_the_scheduler_half_by_pp_and_tp_rank() -> None:
    e = engine(tp=2, pp=2)
    try:
        assert e.scheduler_connector is not None
        half = e.scheduler_connector.scheduler  # type: ignore[attr-defined]
        assert isinstance(half, RecordingScheduler)
        layers = {
            0: "model.layers.0.self_attn,model.layers.1.self_attn",
            1: "model.layers.2.self_attn,model.layers.3.self_attn",
        }
        assert half.handshakes == [
            {
                (pp, tp): AgentPayload(f"{pp}/{tp}:{layers[pp]}".encode())
                for pp in (0, 1)
                for tp in (0, 1)
            }
        ]
    finally:
        e.shutdown()


def test_wait_for_save_gets_the_steps_metadata_on_every_worker() -> None:
    e = engine(tp=2, pp=1)
    try:
        e.add_request("a", list(range(40)), max_tokens=3)
        e.add_request("b", list(range(100, 120)), max_tokens=2)
        while e.has_pending_work():
            e.step()
        assert e.steps >= 3
        for worker in e.workers:
            half = worker.connector.worker  # type: ignore[union-attr]
            assert isinstance(half, RecordingWorker)
            assert [m.step for m in half.waited] == list(range(1, e.steps + 1))
            # the very object this step's loads got (the worker's own copy of the step's)
            assert all(w is load for w, load in zip(half.waited, half.loads, strict=True))
            assert {id(m) for m in half.saved} <= {id(m) for m in half.waited}
        first, second = (w.connector.worker.waited for w in e.workers)  # type: ignore[union-attr]
        assert all(a is not b for a, b in zip(first, second))  # each worker has its own copy
    finally:
        e.shutdown()


def scheduler_side() -> HandshakeHalves:
    return HandshakeHalves(
        KVTransferConfig(kv_connector="HandshakeHalves", kv_role="kv_both"),
        KVConnectorRole.SCHEDULER,
        EngineConfig().context(ParallelInfo()),
    )


def test_a_tp_only_engine_hands_the_scheduler_half_pp_rank_0() -> None:
    sched = scheduler_side()
    sched.set_xfer_handshake_metadata({0: AgentPayload(b"x"), 1: AgentPayload(b"y")})
    assert sched.scheduler.handshakes == [{(0, 0): AgentPayload(b"x"), (0, 1): AgentPayload(b"y")}]


def test_another_connectors_handshake_kind_is_left_out_with_a_warning(caplog: Any) -> None:
    """A MultiConnector hands every child its first child's metadata (as vLLM does)."""
    sched = scheduler_side()
    sched.set_xfer_handshake_metadata_pp_aware({(0, 0): WorkerAddress(5000)})
    assert sched.scheduler.handshakes == []
    assert "ranks [(0, 0)] is ['WorkerAddress'], not AgentPayload" in caplog.text
    mixed = {(0, 0): AgentPayload(b"x"), (0, 1): WorkerAddress(5000)}
    sched.set_xfer_handshake_metadata_pp_aware(mixed)
    assert sched.scheduler.handshakes == [{(0, 0): AgentPayload(b"x")}]
