"""The workers' LMCache engines: built, shared within a process, and torn down.

An LMCache engine lives as long as its process, as in vLLM (one engine per worker process):
kvx engines of one process with the same LMCache options and the same shard (model, world
size, rank, KV shape) share one, and an engine whose last user shut down is kept while only its
local tier holds the chunks (its CPU or disk chunks are the cache a restarted kvx engine in the
process finds) until the process builds another engine (each allocates its whole CPU tier
up front, LMCache's default 5 GB: idle ones are destroyed before a new one is built, so
an idle tier never sits beside a newly allocated one), and destroyed at process exit.
Engines with a remote tier (the chunks outlive them there) are destroyed when their last user
shuts down, and once no engine is left, LMCache's process-wide pin monitor thread is stopped
too (LMCache's own destroy leaves it running).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import threading
import uuid
from typing import Any

import torch

import kvx
from kvx.layouts import Layout
from kvx.plugins.lmcache.config import LMCacheConfig

# LMCache phones home usage statistics unless told not to; kvx never sends traffic anywhere
# but to the stores it is configured with.
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.metadata import LMCacheMetadata

from kvx.plugins.lmcache.paged_copy import (
    LayerwisePagedCPUConnector,
    PagedCPUConnector,
)

logger = logging.getLogger(__name__)

DESTROY_TIMEOUT_S = 10.0


class _Pooled:
    def __init__(self, instance: str, engine: LMCacheEngine, keep: bool) -> None:
        self.instance = instance
        self.engine = engine
        self.keep = keep
        self.users = 0


_lock = threading.Lock()
_pool: dict[str, _Pooled] = {}  # key -> engine, idle ones in the order they became idle


def global_rank(parallel: kvx.ParallelInfo) -> int:
    return parallel.pp_rank * parallel.tp_size + parallel.tp_rank


def acquire_engine(
    options: LMCacheConfig, ctx: kvx.EngineContext, layout: Layout, tensors: list[torch.Tensor]
) -> tuple[str, LMCacheEngine]:
    """This process's LMCache engine for these options and this shard, built on first use;
    returns (pool key, engine). Pair with `release_engine(key)`."""
    sizes = layout.sizes_of(tensors[0])
    key = json.dumps(
        [
            options.lmcache_options(),
            ctx.model_name,
            ctx.parallel.tp_size * ctx.parallel.pp_size,
            global_rank(ctx.parallel),
            len(tensors),
            sizes["heads"],
            sizes["head_size"],
            str(tensors[0].dtype),
            layout.name,
            tensors[0].device.type,
        ],
        sort_keys=True,
    )
    with _lock:
        pooled = _pool.pop(key, None)
        if pooled is None:
            _destroy_idle()
            instance, engine = build_engine(options, ctx, layout, tensors)
            local = options.local_cpu or options.local_disk is not None
            keep = local and options.remote_url is None
            pooled = _Pooled(instance, engine, keep)
        pooled.users += 1
        _pool[key] = pooled  # most recently used last
        return key, pooled.engine


def _destroy_idle() -> None:
    """Destroy every engine no kvx engine uses (called, holding `_lock`, before a new engine is
    built: its CPU tier is allocated in full, so idle tiers are freed first)."""
    for key in [k for k, p in _pool.items() if p.users <= 0]:
        destroy_engine(_pool.pop(key).instance)


def release_engine(key: str) -> None:
    """One user is done: destroy the engine now if it has no local tier (bounded, see
    `destroy_engine`); one with a local tier stays, idle, until another engine is built."""
    with _lock:
        pooled = _pool.get(key)
        if pooled is None:
            return
        pooled.users -= 1
        if pooled.users > 0 or pooled.keep:
            return
        instance = _pool.pop(key).instance
    destroy_engine(instance)
    _stop_process_threads()


def _stop_process_threads() -> None:
    """Once this process has no LMCache engine left, stop the pin monitor LMCache starts once
    per process (`PinMonitor`, a periodic thread `LMCacheEngineBuilder.destroy` leaves behind);
    the next engine built starts a new one."""
    with _lock:
        if _pool:
            return
        from lmcache.v1.pin_monitor import PinMonitor

        PinMonitor.DestroyInstance()


def _quiet_lmcache_logging() -> None:
    """At interpreter exit LMCache's loggers may still hold a stream that is already closed
    (a test runner's capture file, a replaced `sys.stderr`): every record then prints a
    "Logging error" traceback. Point such handlers at the current `sys.stderr`, and keep only
    warnings and errors: the INFO lines of a routine teardown are noise after the program's
    own last line."""
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if not name.startswith("lmcache") or not isinstance(logger, logging.Logger):
            continue
        logger.setLevel(max(logger.level, logging.WARNING))
        for handler in logger.handlers:
            if isinstance(handler, logging.StreamHandler) and getattr(
                handler.stream, "closed", False
            ):
                handler.stream = sys.stderr  # not setStream: it flushes the closed one


def _destroy_all() -> None:
    with _lock:
        doomed = [p.instance for p in _pool.values()]
        _pool.clear()
    if doomed:
        _quiet_lmcache_logging()
    for instance in doomed:
        destroy_engine(instance, timeout_s=5.0)


# LMCache's engine runs a non-daemon thread that only `destroy` stops, and Python joins such
# threads before `atexit` handlers run: destroy kept engines in threading's own exit hook, which
# runs first (where available).
_register_exit = getattr(threading, "_register_atexit", atexit.register)
_register_exit(_destroy_all)


def build_engine(
    options: LMCacheConfig,
    ctx: kvx.EngineContext,
    layout: Layout,
    tensors: list[torch.Tensor],
) -> tuple[str, LMCacheEngine]:
    """A fresh LMCache engine for this worker's layers (`tensors`, in layer order), under a
    unique instance id; its keys name the model, the world size and this worker's rank."""
    sizes = layout.sizes_of(tensors[0])
    heads, head_size = sizes["heads"], sizes["head_size"]
    parallel = ctx.parallel
    world = parallel.tp_size * parallel.pp_size
    rank = global_rank(parallel)
    config = LMCacheEngineConfig.from_defaults(**options.lmcache_options())
    metadata = LMCacheMetadata(
        model_name=ctx.model_name,
        world_size=world,
        local_world_size=world,
        worker_id=rank,
        local_worker_id=rank,
        kv_dtype=tensors[0].dtype,
        kv_shape=(len(tensors), 2, options.chunk_size, heads, head_size),
        chunk_size=options.chunk_size,
        role="worker",
    )
    connector: Any
    if tensors[0].is_cuda:  # LMCache's own CUDA connectors
        from lmcache.utils import EngineType
        from lmcache.v1.gpu_connector import CreateGPUConnector

        connector = CreateGPUConnector(config, metadata, EngineType.VLLM)
    elif options.use_layerwise:
        connector = LayerwisePagedCPUConnector(layout, len(tensors), heads, head_size)
    else:
        connector = PagedCPUConnector(layout, len(tensors), heads, head_size)
    instance = f"kvx-{ctx.engine_id}-{rank}-{uuid.uuid4().hex[:8]}"
    engine = LMCacheEngineBuilder.get_or_create(instance, config, metadata, connector, None, None)
    try:
        engine.post_init()
    except BaseException:
        destroy_engine(instance)
        raise
    return instance, engine


def _unblock_remote_close(instance: str) -> None:
    """LMCache 0.5.6's redis connector closes with `await executor.shutdown(wait=True)`, but
    that `shutdown` is synchronous: it schedules the real (async) shutdown on the event loop and
    blocks that same loop waiting for it, so `destroy` never returns. Give such executors a
    `shutdown` that awaits the asynchronous one instead."""
    engine = LMCacheEngineBuilder.get(instance)
    backends = getattr(getattr(engine, "storage_manager", None), "storage_backends", {}) or {}
    for backend in backends.values():
        connection = getattr(backend, "connection", None)
        connector = getattr(connection, "_connector", connection)  # unwrap the instrumented one
        executor = getattr(connector, "pq_executor", None)
        if executor is None or not hasattr(executor, "shutdown_async"):
            continue

        async def shutdown(wait: bool = True, executor: Any = executor) -> None:
            await executor.shutdown_async(wait)

        executor.shutdown = shutdown


def _close_stopped_loop(manager: Any) -> None:
    """LMCache's storage manager stops its event loop's thread at close but never closes the
    loop, whose selector and wake-up socket pair stay open (three descriptors per engine):
    close it once its thread has ended."""
    loop = getattr(manager, "loop", None)
    thread = getattr(manager, "thread", None)
    if loop is None or loop.is_closed() or loop.is_running():
        return
    if thread is None or not thread.is_alive():
        loop.close()


def destroy_engine(instance: str, timeout_s: float = DESTROY_TIMEOUT_S) -> bool:
    """Destroy the engine in a helper thread and wait at most `timeout_s` (LMCache's remote
    backends' teardown is unblocked first, see `_unblock_remote_close`; the bound covers
    anything else that hangs). Returns whether it finished; if not, the thread is left behind
    (a daemon) and a warning names it."""
    _unblock_remote_close(instance)
    manager = getattr(LMCacheEngineBuilder.get(instance), "storage_manager", None)
    done = threading.Event()

    def run() -> None:
        try:
            LMCacheEngineBuilder.destroy(instance)
            _close_stopped_loop(manager)
        except Exception as exc:
            logger.warning("kvx lmcache: destroying %s failed: %s: %s", instance, type(exc), exc)
        finally:
            done.set()

    thread = threading.Thread(target=run, name=f"kvx-lmcache-destroy-{instance}", daemon=True)
    thread.start()
    if not done.wait(timeout_s):
        logger.warning(
            "kvx lmcache: LMCacheEngineBuilder.destroy(%r) still running after %.0fs; "
            "shutdown returns without it (thread %s left behind)",
            instance,
            timeout_s,
            thread.name,
        )
        return False
    return True
