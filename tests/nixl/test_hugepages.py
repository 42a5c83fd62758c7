"""A NIXL worker moves the CPU KV cache it registers onto huge pages (same bytes, same
addresses), the 2 MiB pages it shares with its neighbours included, unless `huge_pages` is
off."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

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
from kvx.plugins.nixl.hugepages import HUGE_PAGE, huge_range

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


def mappings() -> list[tuple[int, int, int]]:
    """(start, end, AnonHugePages bytes) of every mapping, from /proc/self/smaps."""
    text = Path("/proc/self/smaps").read_text()
    out = []
    for head, body in re.findall(r"^([0-9a-f]+-[0-9a-f]+) .*\n((?:[A-Z]\w*:.*\n)+)", text, re.M):
        lo, hi = (int(x, 16) for x in head.split("-"))
        huge = re.search(r"AnonHugePages:\s+(\d+) kB", body)
        out.append((lo, hi, int(huge.group(1)) << 10 if huge else 0))
    return out


def worker(huge_pages: bool) -> Any:
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
    return create_connector(config, KVConnectorRole.WORKER, ctx)


def register(huge_pages: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    connector = worker(huge_pages)
    layout = get_layout("HND")
    caches = {}
    for i in range(LAYERS):
        name = f"layer.{i}"
        t = layout.allocate(BLOCKS, BLOCK, HEADS, HEAD_SIZE, dtype=torch.bfloat16)
        g = torch.Generator().manual_seed(i)
        t.copy_(torch.randn(t.shape, generator=g).to(torch.bfloat16))
        caches[name] = t
    before = {name: t.clone() for name, t in caches.items()}
    try:
        connector.register_kv_caches(caches)
    finally:
        connector.shutdown()
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


@pytest.mark.timeout(60)
def test_the_2mib_pages_at_a_caches_edges_are_collapsed_and_no_byte_changes() -> None:
    """Two layers inside one buffer, neither on a 2 MiB boundary, one 4 KiB page apart (as
    glibc lays out consecutive allocations), random bytes all around: every 2 MiB page that
    holds a byte of a layer ends up huge, edges shared with the bytes beside included, and no
    byte of the buffer changes."""
    per_layer = 2 * BLOCKS * HEADS * BLOCK * HEAD_SIZE * 2
    buffer = torch.randint(0, 256, (2 * per_layer + 8 * HUGE_PAGE,), dtype=torch.uint8)
    before = buffer.clone()
    anchor = -(-(buffer.data_ptr() + HUGE_PAGE) // HUGE_PAGE) * HUGE_PAGE - buffer.data_ptr()
    like = get_layout("HND").allocate(BLOCKS, BLOCK, HEADS, HEAD_SIZE, dtype=torch.bfloat16)
    caches, pages = {}, set()
    offset = anchor + 3 * 4096 + 64
    for i in range(LAYERS):
        dense = buffer[offset : offset + per_layer].view(torch.bfloat16)
        layer = dense.as_strided(like.shape, like.stride())  # the HND memory order
        caches[f"layer.{i}"] = layer
        start, end = layer.data_ptr(), layer.data_ptr() + per_layer
        assert start % HUGE_PAGE and end % HUGE_PAGE
        pages |= set(range(start // HUGE_PAGE * HUGE_PAGE, end, HUGE_PAGE))
        offset += per_layer + 4096
    connector = worker(huge_pages=True)
    try:
        connector.register_kv_caches(caches)
    finally:
        connector.shutdown()
    assert torch.equal(buffer, before), "a byte of the buffer changed"
    for lo, hi, huge in mappings():
        wanted = sum(HUGE_PAGE for page in pages if lo <= page < hi)
        assert huge >= wanted, f"{(wanted - huge) >> 21} of {wanted >> 21} pages stay small"
    assert sum(1 for page in pages for lo, hi, _ in mappings() if lo <= page < hi) == len(pages)
