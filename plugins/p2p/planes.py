"""The data plane: how a KV tensor's bytes travel once the control plane agreed on them.

One interface, two implementations, driven by the same engine code (`connections.py` and
`listener.py`): a DEALER pairs with a ROUTER once (HELLO, which carries the NCCL unique id),
then every transfer is "announce (PUT header, or GET request) -> the receiver admits or refuses
-> bytes move". What differs is only where the bytes go:

- `CpuPlane`: the bytes ride as zero-copy ZMQ frames behind the announcement (pyzmq
  `copy=False`), on the same TCP connection, so ordering is the connection's order. A slice may
  be several frames (`tensors.block_segments`: views of P's blocks, one per run of blocks), so
  P sends without copying; D keeps the received frames and copies them once into its blocks.
- `NcclPlane` (`nccl.py`): a two-rank NCCL communicator per (DEALER, ROUTER) pair; the receiver
  allocates the device buffer before it replies, then the sender posts `ncclSend` and the
  receiver `ncclRecv`, in the order the control messages fix, each bounded by the timeout.

Why ZMQ frames on CPU and not torch.distributed gloo send/recv: `benchmarks/bench_p2p.py`
moves the same 128 MiB both ways in one run; on this (shared, loaded) 2-core machine raw
zero-copy ZMQ frames were 1.3x to 9.9x faster than raw gloo send/recv (medians of 3-5 rounds,
docs/performance.md), and they need no process group.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any

import torch

from kvx.plugins.p2p.messages import TensorMeta
from kvx.plugins.p2p.tensors import MAX_SEGMENTS, Segments, frombuffer

logger = logging.getLogger(__name__)


class PlaneError(RuntimeError):
    """The data plane could not move a tensor (the request fails, the engine goes on)."""


class DataPlane(ABC):
    """Moves the bytes of one tensor between a paired DEALER (rank 0) and ROUTER (rank 1)."""

    name: str
    sends_views = False
    """True if `frames`/`deliver` take views of the KV cache as they are (several segments);
    False if the worker must hand over one contiguous copy (the data leaves after the reply)."""

    def new_pair_id(self) -> bytes:
        """DEALER side: the id the HELLO carries (NCCL: a fresh unique id)."""
        return b""

    def join(self, pair: bytes, pair_id: bytes, rank: int) -> None:
        """Both sides, after the HELLO reply: set up the channel of `pair`."""

    def leave(self, pair: bytes) -> None:
        """Forget the channel of `pair` (peer gone or closed)."""

    @abstractmethod
    def frames(self, data: Segments) -> list[Any]:
        """Frames sent right behind the announcement of `data` (contiguous uint8 segments)."""

    @abstractmethod
    def check(self, meta: TensorMeta, frames: list[Any]) -> str | None:
        """Receiver, before it admits `meta`: None if `frames` are what this plane expects."""

    def prepare(self, pair: bytes, meta: TensorMeta) -> Any:
        """Receiver, before it admits a PUT of `meta`: whatever `collect` will fill (PlaneError
        if it cannot take it)."""
        return None

    @abstractmethod
    def deliver(self, pair: bytes, data: Segments) -> None:
        """Sender, after the receiver admitted `data`: move its bytes."""

    @abstractmethod
    def collect(
        self, pair: bytes, meta: TensorMeta, frames: list[Any], prepared: Any = None
    ) -> tuple[Segments, Any]:
        """Receiver, after it admitted `meta`: the uint8 segments and what must outlive them."""

    def close(self) -> None:
        """Release every channel."""


class CpuPlane(DataPlane):
    """Bytes as zero-copy ZMQ frames (1 to `MAX_SEGMENTS`) behind the control frame."""

    name = "cpu"
    sends_views = True

    def frames(self, data: Segments) -> list[Any]:
        return [memoryview(s.numpy()) for s in data]  # type: ignore[arg-type]  # a buffer

    def check(self, meta: TensorMeta, frames: list[Any]) -> str | None:
        if not 1 <= len(frames) <= MAX_SEGMENTS:
            return f"expected 1 to {MAX_SEGMENTS} data frames, got {len(frames)}"
        size = sum(len(f.buffer) for f in frames)
        if size != meta.nbytes:
            return f"data frames of {size} bytes, {meta.nbytes} announced"
        return None

    def deliver(self, pair: bytes, data: Segments) -> None:
        """Nothing: the frames already went with the announcement."""

    def collect(
        self, pair: bytes, meta: TensorMeta, frames: list[Any], prepared: Any = None
    ) -> tuple[Segments, Any]:
        problem = self.check(meta, frames)
        if problem is not None:
            raise PlaneError(problem)
        return [frombuffer(f.buffer) for f in frames if len(f.buffer)], frames


def choose_plane(
    setting: str, device: torch.device, num_channels: int, timeout_s: float = 30.0
) -> DataPlane:
    """`auto`: NCCL for CUDA KV caches, CPU otherwise; the choice is logged."""
    use_nccl = setting == "nccl" or (setting == "auto" and device.type == "cuda")
    if use_nccl:
        if device.type != "cuda":
            raise ValueError(
                f"data_plane: 'nccl' needs the KV cache on CUDA, it is on {device}; "
                "use 'cpu' or 'auto'"
            )
        from kvx.plugins.p2p.nccl import NcclPlane

        plane: DataPlane = NcclPlane(device, num_channels, timeout_s)
    else:
        plane = CpuPlane()
    logger.info("P2P data plane: %s (data_plane=%s, KV cache on %s)", plane.name, setting, device)
    return plane
