"""P2P background threads run off the cores vLLM-CPU binds its inference threads to.

vLLM-CPU pins a worker's main thread to its compute cores (`VLLM_CPU_OMP_THREADS_BIND`), and a
thread inherits the affinity of the thread that starts it, so the P2P listener, PUT_ASYNC sender
and GET fetchers would share those cores with the forward pass and with vLLM's busy-polling
worker loop (`os.sched_yield` between steps). When two engines share a core (as in the tests'
1P1D on two cores), the other engine's spinning worker left this worker's threads runnable with
no CPU at all for seconds: P's listener answered D's GET after 23 s, or not within D's timeout.
The threads here take the affinity of the process that started the worker (not bound by vLLM),
so the kernel can run them on any core that process may use. vLLM's own NIXL connector on CPU
moves its transfer threads off the forward's cores for the same reason.
"""

from __future__ import annotations

import logging
import os
import threading

logger = logging.getLogger(__name__)
_logged = threading.Event()


def process_cpus() -> set[int]:
    """The CPUs the worker's parent may use (the affinity vLLM's binding narrowed), or every
    CPU: the kernel keeps a thread within its cpuset either way."""
    try:
        return set(os.sched_getaffinity(os.getppid()))
    except OSError:
        return set(range(os.cpu_count() or 1))


def leave_compute_cores() -> None:
    """Let the calling thread run on every CPU of `process_cpus` (and those it has now)."""
    if not hasattr(os, "sched_setaffinity"):
        return
    now: set[int] = set()
    try:
        now = os.sched_getaffinity(0)
        wanted = now | process_cpus()
        if wanted != now:
            os.sched_setaffinity(0, wanted)
    except OSError as exc:  # a cpuset that forbids it: keep the inherited cores
        logger.warning("P2P thread %s keeps CPUs %s: %s", threading.current_thread().name, now, exc)
        return
    if wanted != now and not _logged.is_set():
        _logged.set()
        logger.info(
            "P2P background threads run on CPUs %s, not only the inference cores %s",
            sorted(wanted),
            sorted(now),
        )
