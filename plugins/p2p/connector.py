"""P2pNcclConnector: prefill/decode hand-off between workers, vLLM's legacy P2P NCCL design.

The facade builds the role's half: `scheduler.py` decides what P saves and D loads each step,
`worker.py` moves the bytes through a per-worker `P2pEngine` (ZMQ control plane; NCCL data plane
on CUDA, ZMQ frames on CPU). Matches vLLM's `P2pNcclConnector` (`kv_connector/v1/p2p/` in vLLM
up to 0.32) and goes beyond it: any TP pair, block size or layout on either side, asynchronous
GET loads, sealed messages.
"""

from __future__ import annotations

from kvx import ANY_GEOMETRY, Capability, KVTransferConfig, RoleSplitConnector
from kvx.plugins.p2p.config import P2pConfig
from kvx.plugins.p2p.scheduler import P2pScheduler
from kvx.plugins.p2p.stats import P2pKVConnectorStats
from kvx.plugins.p2p.worker import P2pWorker


class P2pNcclConnector(RoleSplitConnector[P2pScheduler, P2pWorker]):
    """P pushes its prompt's KV to D (PUT, PUT_ASYNC) or keeps it for D to pull (GET); P never
    holds blocks after a request finishes (it sends copies)."""

    capabilities = ANY_GEOMETRY | {Capability.REMOTE_PREFILL, Capability.ASYNC_LOAD, Capability.MLA}
    extra_config_schema = P2pConfig
    stats_type = P2pKVConnectorStats

    @classmethod
    def fault_wait_s(cls, config: KVTransferConfig) -> float:
        """Any exchange with a dead or silent peer ends after `transfer_timeout_s`."""
        return config.extra_config_as(P2pConfig).transfer_timeout_s

    @classmethod
    def claims_for(cls, config: KVTransferConfig) -> frozenset[Capability]:
        """Loads are asynchronous only with GET: in PUT modes the KV is pushed before D sees
        the request and D loads it within the step (vLLM's behaviour)."""
        claims = set(cls.capabilities)
        if config.extra_config_as(P2pConfig).send_type != "GET":
            claims.discard(Capability.ASYNC_LOAD)
        return frozenset(claims)


P2pNcclConnectorV1 = P2pNcclConnector
