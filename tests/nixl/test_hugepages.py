"""A NIXL worker moves the CPU KV cache it registers onto huge pages (same bytes, same
addresses), unless `huge_pages` is off."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from kvx import (
    EngineContext,
    KVCacheSpec,
    KVConnectorRole,
    KVTransferConfig,
    ParallelInfo,
    create_connector,
)
from kvx.layouts import get_layout
from kvx.plugins.nixl.hugepages import huge_range

# 40 MiB per layer (bfloat16): above glibc's largest mmap threshold, so every tensor is a fresh
# mapping (a reused one may carry an earlier test's huge pages)
LAYERS, HEADS, HEAD_SIZE, BLOCK, BLOCKS = 2, 4, 128, 16, 1280


def huge_bytes_at(address: int) -> int:
    """AnonHugePages of the mapping that holds `address`, from /proc/self/smaps."""
    text = Path("/proc/self/smaps").read_text()
    for head, body in re.findall(r"^([0-9a-f]+-[0-9a-f]+) .*\n((?:[A-Z]\w*:.*\n)+)", text, re.M):
        lo, hi = (int(x, 16) for x in head.split("-"))
        if lo <= address < hi:
            return int(re.search(r"AnonHugePages:\s+(\d+) kB", body).group(1)) << 10  # type: ignore[union-attr]
    raise AssertionError(f"no mapping holds {address:#x}")


def register(huge_pages: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    spec = KVCacheSpec(
        layer_names=tuple(f"layer.{i}" for i in range(LAYERS)),
        num_kv_heads=HEADS,
        head_size=HEAD_SIZE,
        block_size=BLOCK,
        dtype="bfloat16",
        layout="HND",
        num_blocks=BLOCKS,
    )
    ctx = EngineContext("E", "test", spec, ParallelInfo())
    config = KVTransferConfig.from_dict(
        {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"huge_pages": huge_pages},
        }
    )
    worker = create_connector(config, KVConnectorRole.WORKER, ctx)
    layout = get_layout("HND")
    caches = {}
    for i, name in enumerate(spec.layer_names):
        t = layout.allocate(BLOCKS, BLOCK, HEADS, HEAD_SIZE, dtype=torch.bfloat16)
        g = torch.Generator().manual_seed(i)
        t.copy_(torch.randn(t.shape, generator=g).to(torch.bfloat16))
        caches[name] = t
    before = {name: t.clone() for name, t in caches.items()}
    try:
        worker.register_kv_caches(caches)
    finally:
        worker.shutdown()
    return caches, before


@pytest.mark.timeout(60)
def test_registered_cache_is_on_huge_pages_with_its_bytes() -> None:
    caches, before = register(huge_pages=True)
    for name, t in caches.items():
        start, length = huge_range(t)
        assert length >= 8 << 20
        assert huge_bytes_at(start) >= length, f"{name} is not on huge pages"
        assert torch.equal(t, before[name]), f"{name} changed"


@pytest.mark.timeout(60)
def test_huge_pages_off_leaves_the_cache_alone() -> None:
    enabled = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    assert "[always]" not in enabled, "THP 'always' backs every mapping: nothing to tell apart"
    caches, before = register(huge_pages=False)
    for name, t in caches.items():
        assert huge_bytes_at(huge_range(t)[0]) == 0, f"{name} went on huge pages anyway"
        assert torch.equal(t, before[name])
