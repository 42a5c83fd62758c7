"""The data plane: how a KV tensor's bytes travel once the control plane agreed on them.

One interface, two implementations, driven by the same engine code (`engine.py`): a DEALER
pairs with a ROUTER once (HELLO, which carries the NCCL unique id), then every transfer is
"announce (PUT header, or GET request) -> the receiver admits or refuses -> bytes move". What
differs is only where the bytes go:

- `CpuPlane`: the bytes ride as one zero-copy ZMQ frame behind the announcement (pyzmq
  `copy=False`), on the same TCP connection, so ordering is the connection's order.
- `NcclPlane` (`nccl.py`): a two-rank NCCL communicator per (DEALER, ROUTER) pair; after the
  receiver's reply the sender posts `ncclSend` and the receiver `ncclRecv`, in the order the
  control messages fix.

Why ZMQ frames on CPU and not torch.distributed gloo send/recv: `benchmarks/bench_p2p.py`
moves the same 128 MiB both ways in one run; on this (shared, loaded) 2-core machine raw
zero-copy ZMQ frames were 3.4x to 9.9x faster than raw gloo send/recv (medians of 3-5 rounds,
docs/performance.md), and they need no process group.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any

import torch

from kvx.plugins.p2p.messages import TensorMeta
from kvx.plugins.p2p.tensors import frombuffer

logger = logging.getLogger(__name__)


class PlaneError(RuntimeError):
    """The data plane could not move a tensor (the request fails, the engine goes on)."""


class DataPlane(ABC):
    """Moves the bytes of one tensor between a paired DEALER (rank 0) and ROUTER (rank 1)."""

    name: str

    def new_pair_id(self) -> bytes:
        """DEALER side: the id the HELLO carries (NCCL: a fresh unique id)."""
        return b""

    def join(self, pair: bytes, pair_id: bytes, rank: int) -> None:
        """Both sides, after the HELLO reply: set up the channel of `pair`."""

    def leave(self, pair: bytes) -> None:
        """Forget the channel of `pair` (peer gone or closed)."""

    @abstractmethod
    def frames(self, data: torch.Tensor) -> list[Any]:
        """Frames sent right behind the announcement of `data` (uint8, contiguous)."""

    @abstractmethod
    def check(self, meta: TensorMeta, frames: list[Any]) -> str | None:
        """Receiver, before it admits `meta`: None if `frames` are what this plane expects."""

    @abstractmethod
    def deliver(self, pair: bytes, data: torch.Tensor) -> None:
        """Sender, after the receiver admitted `data`: move its bytes."""

    @abstractmethod
    def collect(self, pair: bytes, meta: TensorMeta, frames: list[Any]) -> tuple[torch.Tensor, Any]:
        """Receiver, after it admitted `meta`: the uint8 bytes and what must outlive them."""

    def close(self) -> None:
        """Release every channel."""


class CpuPlane(DataPlane):
    """Bytes as one zero-copy ZMQ frame behind the control frame."""

    name = "cpu"

    def frames(self, data: torch.Tensor) -> list[Any]:
        return [memoryview(data.numpy())]  # type: ignore[arg-type]  # ndarray is a buffer

    def check(self, meta: TensorMeta, frames: list[Any]) -> str | None:
        if len(frames) != 1:
            return f"expected 1 data frame, got {len(frames)}"
        size = len(frames[0].buffer)
        if size != meta.nbytes:
            return f"data frame of {size} bytes, {meta.nbytes} announced"
        return None

    def deliver(self, pair: bytes, data: torch.Tensor) -> None:
        """Nothing: the frame already went with the announcement."""

    def collect(self, pair: bytes, meta: TensorMeta, frames: list[Any]) -> tuple[torch.Tensor, Any]:
        problem = self.check(meta, frames)
        if problem is not None:
            raise PlaneError(problem)
        if meta.nbytes == 0:
            return torch.empty(0, dtype=torch.uint8), None
        return frombuffer(frames[0].buffer), frames[0]


def choose_plane(setting: str, device: torch.device, num_channels: int) -> DataPlane:
    """`auto`: NCCL for CUDA KV caches, CPU otherwise; the choice is logged."""
    use_nccl = setting == "nccl" or (setting == "auto" and device.type == "cuda")
    if use_nccl:
        if device.type != "cuda":
            raise ValueError(
                f"data_plane: 'nccl' needs the KV cache on CUDA, it is on {device}; "
                "use 'cpu' or 'auto'"
            )
        from kvx.plugins.p2p.nccl import NcclPlane

        plane: DataPlane = NcclPlane(device, num_channels)
    else:
        plane = CpuPlane()
    logger.info("P2P data plane: %s (data_plane=%s, KV cache on %s)", plane.name, setting, device)
    return plane
