"""The NCCL data plane: one two-rank communicator per (DEALER, ROUTER) pair, bound through
ctypes to the `libnccl.so.2` that CUDA builds of torch ship (no torch.distributed group).

As in vLLM's legacy P2pNcclEngine (reviewed against it: docs/connectors/p2p.md): the DEALER
creates the unique id (`ncclGetUniqueId`) and sends it in its HELLO; both sides then call
`ncclCommInitRank(2, id, rank)` with the DEALER as rank 0, with `NCCL_MIN/MAX_NCHANNELS` and
`NCCL_CUMEM_ENABLE=1` set only around that call; a transfer is `ncclSend`/`ncclRecv` of the
tensor's bytes to rank `1 - rank`, sends and receives on separate streams. Unlike vLLM, nothing
waits unbounded: an init, send or receive that the peer never matches fails after the timeout
(the communicator is aborted), so a vanished peer cannot stop the listener. Only runs where
CUDA is present; tests/p2p/test_nccl.py reports its tests as not run elsewhere.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from kvx.plugins.p2p.messages import TensorMeta
from kvx.plugins.p2p.planes import DataPlane, PlaneError
from kvx.plugins.p2p.tensors import Segments

logger = logging.getLogger(__name__)
UNIQUE_ID_BYTES = 128
NCCL_UINT8 = 1
POLL_S = 0.001


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_BYTES)]


def load_nccl() -> ctypes.CDLL:
    """libnccl with the signatures this plane calls, or `PlaneError` saying how to get it."""
    for name in (os.environ.get("KVX_NCCL_LIBRARY", ""), "libnccl.so.2", "libnccl.so"):
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        comm, p, size = ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        lib.ncclGetErrorString.argtypes = [ctypes.c_int]
        lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(_UniqueId)]
        lib.ncclCommInitRank.argtypes = [
            ctypes.POINTER(comm),
            ctypes.c_int,
            _UniqueId,
            ctypes.c_int,
        ]
        for call in (lib.ncclSend, lib.ncclRecv):
            call.argtypes = [p, size, ctypes.c_int, ctypes.c_int, comm, p]
        lib.ncclCommAbort.argtypes = [comm]
        return lib
    raise PlaneError(
        "data_plane 'nccl': libnccl.so.2 not found (install a CUDA build of torch, which "
        "ships it, or point KVX_NCCL_LIBRARY at it)"
    )


_ENV_LOCK = threading.Lock()
_ENV_USERS = 0
_ENV_SAVED: dict[str, str | None] = {}


@contextmanager
def nccl_env(num_channels: int) -> Iterator[None]:
    """NCCL_MIN/MAX_NCHANNELS and NCCL_CUMEM_ENABLE for the communicators created inside, the
    process's own values restored once the last concurrent user leaves (vLLM's other NCCL
    groups must not inherit them)."""
    global _ENV_USERS
    wanted = {
        "NCCL_MAX_NCHANNELS": str(num_channels),
        "NCCL_MIN_NCHANNELS": str(num_channels),
        "NCCL_CUMEM_ENABLE": "1",
    }
    with _ENV_LOCK:
        if _ENV_USERS == 0:
            _ENV_SAVED.update({k: os.environ.get(k) for k in wanted})
            os.environ.update(wanted)
        _ENV_USERS += 1
    try:
        yield
    finally:
        with _ENV_LOCK:
            _ENV_USERS -= 1
            if _ENV_USERS == 0:
                for key, value in _ENV_SAVED.items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value
                _ENV_SAVED.clear()


class NcclPlane(DataPlane):
    name = "nccl"

    def __init__(self, device: torch.device, num_channels: int, timeout_s: float = 30.0) -> None:
        self.device, self.num_channels, self.timeout_s = device, num_channels, timeout_s
        self._lib = load_nccl()
        self._comms: dict[bytes, tuple[ctypes.c_void_p, int]] = {}
        self._ready: dict[bytes, threading.Event] = {}
        # Separate streams, as vLLM: a receive queued ahead of a send on one stream would wait
        # for it, and two workers sending to each other would deadlock.
        self._send_stream = torch.cuda.Stream(device=device)
        self._recv_stream = torch.cuda.Stream(device=device)
        self._lock = threading.Lock()

    def _check(self, result: int, call: str) -> None:
        if result != 0:
            text = self._lib.ncclGetErrorString(result).decode(errors="replace")
            raise PlaneError(f"{call} failed: {text} (ncclResult {result})")

    def new_pair_id(self) -> bytes:
        uid = _UniqueId()
        self._check(self._lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return bytes(uid.internal)

    def join(self, pair: bytes, pair_id: bytes, rank: int) -> None:
        """Start `ncclCommInitRank` (blocking in NCCL until both ranks call it) on a thread of
        its own; the DEALER (rank 0) waits for it here, the ROUTER's listener does not (its
        first transfer waits in `_comm`), so a peer gone before it joins costs one stuck thread
        and a timeout, never the listener."""
        if len(pair_id) != UNIQUE_ID_BYTES:
            raise PlaneError(f"NCCL unique id of {len(pair_id)} bytes, {UNIQUE_ID_BYTES} needed")
        uid = _UniqueId()
        ctypes.memmove(uid.internal, pair_id, UNIQUE_ID_BYTES)
        ready = threading.Event()
        with self._lock:
            self._ready[pair] = ready

        def init() -> None:
            comm = ctypes.c_void_p()
            try:
                with torch.cuda.device(self.device), nccl_env(self.num_channels):
                    result = self._lib.ncclCommInitRank(ctypes.byref(comm), 2, uid, rank)
                self._check(result, "ncclCommInitRank")
            except Exception as exc:  # reported by `_comm` as "no communicator"
                logger.error("NCCL pair set-up (rank %d) failed: %s", rank, exc)
            else:
                with self._lock:
                    if self._ready.get(pair) is ready:
                        self._comms[pair] = (comm, rank)
                    else:  # left meanwhile
                        self._lib.ncclCommAbort(comm)
            finally:
                ready.set()

        threading.Thread(target=init, name="kvx-nccl-init", daemon=True).start()
        if rank == 0:
            self._comm(pair)

    def leave(self, pair: bytes) -> None:
        with self._lock:
            self._ready.pop(pair, None)
            entry = self._comms.pop(pair, None)
        if entry is not None:
            self._lib.ncclCommAbort(entry[0])  # never waits for operations the peer won't match

    def _comm(self, pair: bytes) -> tuple[ctypes.c_void_p, int]:
        with self._lock:
            ready = self._ready.get(pair)
        if ready is None:
            raise PlaneError("no NCCL communicator for this peer (it never sent HELLO)")
        if not ready.wait(self.timeout_s):
            self.leave(pair)
            raise PlaneError(
                f"ncclCommInitRank: the peer did not join within {self.timeout_s:.0f}s"
            )
        with self._lock:
            entry = self._comms.get(pair)
        if entry is None:
            raise PlaneError("the NCCL communicator for this peer could not be created")
        return entry

    def frames(self, data: Segments) -> list[Any]:
        return []

    def check(self, meta: TensorMeta, frames: list[Any]) -> str | None:
        return f"NCCL plane: {len(frames)} unexpected data frames" if frames else None

    def prepare(self, pair: bytes, meta: TensorMeta) -> Any:
        """The device buffer the bytes land in, allocated (and the communicator checked) before
        the receiver says yes: a CUDA out-of-memory error or a missing communicator then refuses
        the PUT instead of stranding the sender."""
        self._comm(pair)
        try:
            return torch.empty(meta.nbytes, dtype=torch.uint8, device=self.device)
        except torch.cuda.OutOfMemoryError as exc:
            raise PlaneError(f"no device memory for {meta.nbytes} bytes: {exc}") from None

    def deliver(self, pair: bytes, segments: Segments) -> None:
        data = segments[0] if len(segments) == 1 else torch.cat(segments)
        if data.device != self.device or data.dtype != torch.uint8 or not data.is_contiguous():
            raise PlaneError(
                f"NCCL plane sends contiguous uint8 tensors on {self.device}, got "
                f"{data.dtype} on {data.device}"
            )
        comm, rank = self._comm(pair)
        self._send_stream.wait_stream(torch.cuda.current_stream(self.device))
        self._run(pair, comm, self._lib.ncclSend, data, rank, self._send_stream, "ncclSend")

    def collect(
        self, pair: bytes, meta: TensorMeta, frames: list[Any], prepared: Any = None
    ) -> tuple[Segments, Any]:
        if frames:
            raise PlaneError(f"NCCL plane: {len(frames)} unexpected data frames")
        out = prepared if prepared is not None else self.prepare(pair, meta)
        comm, rank = self._comm(pair)
        self._run(pair, comm, self._lib.ncclRecv, out, rank, self._recv_stream, "ncclRecv")
        return [out], None

    def _run(
        self,
        pair: bytes,
        comm: ctypes.c_void_p,
        call: Any,
        data: torch.Tensor,
        rank: int,
        stream: torch.cuda.Stream,
        name: str,
    ) -> None:
        """Post `call` on `stream` and wait for it, at most `timeout_s`; a peer that never
        matches it gets the communicator aborted and a `PlaneError`."""
        with torch.cuda.stream(stream):
            result = call(
                data.data_ptr(), data.numel(), NCCL_UINT8, 1 - rank, comm, stream.cuda_stream
            )
            self._check(result, name)
            done = torch.cuda.Event()
            done.record(stream)
        deadline = time.monotonic() + self.timeout_s
        while not done.query():
            if time.monotonic() > deadline:
                self.leave(pair)
                raise PlaneError(
                    f"{name} of {data.numel()} bytes: the peer did not match it within "
                    f"{self.timeout_s:.0f}s (communicator aborted)"
                )
            time.sleep(POLL_S)

    def close(self) -> None:
        with self._lock:
            pairs = list(self._ready)
        for pair in pairs:
            self.leave(pair)
