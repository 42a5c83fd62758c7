"""Registering a worker's KV cache with NIXL and describing it to peers (split out of
`worker.py`): the regions of every layer, huge pages for a CPU cache, the NIXL registration,
and the `AgentMetadata` a side channel serves."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

import torch

import kvx
from kvx.layouts import Layout
from kvx.plugins.nixl.handshake import AgentMetadata, Region
from kvx.plugins.nixl.hugepages import collapse_to_huge_pages
from kvx.plugins.nixl.regions import layer_regions
from kvx.wire import encode

logger = logging.getLogger(__name__)


@dataclass
class Registered:
    """A registered KV cache: its regions, NIXL registration handle, memory type, device."""

    regions: list[Region]
    handle: Any
    mem_type: Literal["DRAM", "VRAM"]
    device: int


def register_caches(
    agent: Any, kv_caches: dict[str, torch.Tensor], layout: Layout, huge_pages: bool
) -> Registered:
    """Register every layer's tensor (cpu or cuda, dense in `layout`) with `agent`."""
    regions: list[Region] = []
    for name, tensor in kv_caches.items():
        if tensor.device.type not in ("cpu", "cuda"):
            raise ValueError(
                f"layer {name}: NIXL registers cpu or cuda tensors, not {tensor.device}"
            )
        regions += layer_regions(name, layout, tensor)
    first = next(iter(kv_caches.values()))
    mem_type: Literal["DRAM", "VRAM"] = "VRAM" if first.device.type == "cuda" else "DRAM"
    device = first.device.index or 0
    if huge_pages and mem_type == "DRAM":
        collapsed = collapse_to_huge_pages(kv_caches.values())
        total = sum(t.numel() * t.element_size() for t in kv_caches.values())
        logger.info("KV cache: %d of %d MiB on huge pages", collapsed >> 20, total >> 20)
    # layers of different KV-cache groups may share one tensor (vLLM's hybrid allocator):
    # its memory is registered once
    ranges = {(t.data_ptr(), t.numel() * t.element_size()) for t in kv_caches.values()}
    handle = agent.register_memory(
        [(addr, size, device, "") for addr, size in sorted(ranges)], mem_type
    )
    return Registered(regions, handle, mem_type, device)


def agent_payload(
    engine_id: str, agent: Any, ctx: kvx.EngineContext, layout: Layout, registered: Registered
) -> kvx.AgentPayload:
    """This worker's encoded `AgentMetadata` (what its scheduler's side channel serves)."""
    cache, p = ctx.cache, ctx.parallel
    meta = AgentMetadata(
        engine_id=engine_id,
        agent_metadata=agent.get_agent_metadata(),
        pp_rank=p.pp_rank,
        tp_rank=p.tp_rank,
        tp_size=p.tp_size,
        pp_size=p.pp_size,
        num_kv_heads=cache.num_kv_heads,
        head_size=cache.head_size,
        block_size=cache.block_size,
        layout=layout.name,
        dtype=cache.dtype,
        is_mla=cache.use_mla,
        regions=registered.regions,
        device_id=registered.device,
        mem_type=registered.mem_type,
    )
    return kvx.AgentPayload(encode(meta))
