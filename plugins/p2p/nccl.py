"""The NCCL data plane: one two-rank communicator per (DEALER, ROUTER) pair, bound through
ctypes to the `libnccl.so.2` that CUDA builds of torch ship (no torch.distributed group).

Follows vLLM's legacy P2pNcclEngine: the DEALER creates the unique id (`ncclGetUniqueId`) and
sends it in its HELLO; after the reply both sides call `ncclCommInitRank(2, id, rank)` with
the DEALER as rank 0, under `NCCL_MIN/MAX_NCHANNELS` and `NCCL_CUMEM_ENABLE=1`. A transfer is
`ncclSend`/`ncclRecv` of the tensor's bytes (as `ncclUint8`) to rank `1 - rank` on a
dedicated stream, synchronised before the call returns. Only runs where CUDA is present;
tests/p2p/test_nccl.py reports its tests as not run elsewhere.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

import torch

from kvx.plugins.p2p.messages import TensorMeta
from kvx.plugins.p2p.planes import DataPlane, PlaneError
from kvx.plugins.p2p.tensors import Segments

UNIQUE_ID_BYTES = 128
NCCL_UINT8 = 1


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_BYTES)]


def load_nccl() -> ctypes.CDLL:
    """libnccl, or `PlaneError` saying how to get it."""
    for name in (os.environ.get("KVX_NCCL_LIBRARY", ""), "libnccl.so.2", "libnccl.so"):
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        return lib
    raise PlaneError(
        "data_plane 'nccl': libnccl.so.2 not found (install a CUDA build of torch, which "
        "ships it, or point KVX_NCCL_LIBRARY at it)"
    )


class NcclPlane(DataPlane):
    name = "nccl"

    def __init__(self, device: torch.device, num_channels: int) -> None:
        self.device = device
        self._lib = load_nccl()
        self._comms: dict[bytes, tuple[ctypes.c_void_p, int]] = {}
        self._stream = torch.cuda.Stream(device=device)
        self._lock = threading.Lock()
        os.environ["NCCL_MAX_NCHANNELS"] = str(num_channels)
        os.environ["NCCL_MIN_NCHANNELS"] = str(num_channels)
        os.environ["NCCL_CUMEM_ENABLE"] = "1"

    def _check(self, result: int, call: str) -> None:
        if result != 0:
            text = self._lib.ncclGetErrorString(result).decode(errors="replace")
            raise PlaneError(f"{call} failed: {text} (ncclResult {result})")

    def new_pair_id(self) -> bytes:
        uid = _UniqueId()
        self._check(self._lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return bytes(uid.internal)

    def join(self, pair: bytes, pair_id: bytes, rank: int) -> None:
        if len(pair_id) != UNIQUE_ID_BYTES:
            raise PlaneError(f"NCCL unique id of {len(pair_id)} bytes, {UNIQUE_ID_BYTES} needed")
        uid = _UniqueId()
        ctypes.memmove(uid.internal, pair_id, UNIQUE_ID_BYTES)
        comm = ctypes.c_void_p()
        with torch.cuda.device(self.device):
            self._check(
                self._lib.ncclCommInitRank(ctypes.byref(comm), 2, uid, rank), "ncclCommInitRank"
            )
        with self._lock:
            self._comms[pair] = (comm, rank)

    def leave(self, pair: bytes) -> None:
        with self._lock:
            entry = self._comms.pop(pair, None)
        if entry is not None:
            self._lib.ncclCommDestroy(entry[0])

    def _comm(self, pair: bytes) -> tuple[ctypes.c_void_p, int]:
        with self._lock:
            entry = self._comms.get(pair)
        if entry is None:
            raise PlaneError("no NCCL communicator for this peer (it never sent HELLO)")
        return entry

    def frames(self, data: Segments) -> list[Any]:
        return []

    def check(self, meta: TensorMeta, frames: list[Any]) -> str | None:
        return f"NCCL plane: {len(frames)} unexpected data frames" if frames else None

    def deliver(self, pair: bytes, segments: Segments) -> None:
        data = segments[0] if len(segments) == 1 else torch.cat(segments)
        comm, rank = self._comm(pair)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            result = self._lib.ncclSend(
                ctypes.c_void_p(data.data_ptr()),
                ctypes.c_size_t(data.numel()),
                NCCL_UINT8,
                1 - rank,
                comm,
                ctypes.c_void_p(self._stream.cuda_stream),
            )
        self._check(result, "ncclSend")
        self._stream.synchronize()

    def collect(self, pair: bytes, meta: TensorMeta, frames: list[Any]) -> tuple[Segments, Any]:
        if frames:
            raise PlaneError(f"NCCL plane: {len(frames)} unexpected data frames")
        comm, rank = self._comm(pair)
        out = torch.empty(meta.nbytes, dtype=torch.uint8, device=self.device)
        with torch.cuda.stream(self._stream):
            result = self._lib.ncclRecv(
                ctypes.c_void_p(out.data_ptr()),
                ctypes.c_size_t(meta.nbytes),
                NCCL_UINT8,
                1 - rank,
                comm,
                ctypes.c_void_p(self._stream.cuda_stream),
            )
        self._check(result, "ncclRecv")
        self._stream.synchronize()
        return [out], None

    def close(self) -> None:
        for pair in list(self._comms):
            self.leave(pair)
