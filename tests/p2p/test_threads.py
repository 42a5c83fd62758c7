"""P2P's background threads are not confined to the core vLLM-CPU pins a worker to.

vLLM-CPU binds a worker's main thread to its inference cores and new threads inherit that; a
P2P listener there shared the core with the forward pass and with whatever else was bound to it
(issue 14: a decode engine busy-polling on the same core kept P's listener off the CPU until D's
GET timed out). Real threads in a real child process: it binds its main thread to one CPU, as
vLLM does, then starts a listener, a PUT_ASYNC sender and a GET pool; each must be allowed on
every CPU its parent (the process that started the worker) may use.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ._ports import free_port_range

CHILD = """
import json, os, sys, time
from concurrent.futures import ThreadPoolExecutor
from kvx.plugins.p2p.affinity import leave_compute_cores
from kvx.plugins.p2p.engine import P2pEngine
from kvx.plugins.p2p.messages import Geometry
from kvx.plugins.p2p.planes import CpuPlane
from kvx.plugins.p2p.sender import AsyncSender

port, cpu = int(sys.argv[1]), int(sys.argv[2])
os.sched_setaffinity(0, {cpu})  # what VLLM_CPU_OMP_THREADS_BIND does to a worker
geometry = Geometry(1, 1, 2, 4, 4, "NHD", "float32", False, 1)
engine = P2pEngine("affinity", ("127.0.0.1", port), CpuPlane(), geometry, secret=None,
                   timeout_s=5, max_tensor_bytes=1 << 20)
sender = AsyncSender(lambda: None, "kvx-p2p-send-test")
pool = ThreadPoolExecutor(1, initializer=leave_compute_cores)
cpus = {"get pool": pool.submit(lambda: os.sched_getaffinity(0)).result(10)}
deadline = time.monotonic() + 10
while True:  # the listener and the sender move themselves as they start
    cpus["main"] = os.sched_getaffinity(0)
    cpus["listener"] = os.sched_getaffinity(engine.listener.thread.native_id)
    cpus["sender"] = os.sched_getaffinity(sender._thread.native_id)
    moved = len(cpus["listener"]) > 1 and len(cpus["sender"]) > 1
    if moved or time.monotonic() > deadline:
        break
    time.sleep(0.05)
print(json.dumps({name: sorted(c) for name, c in cpus.items()}))
pool.shutdown()
sender.close()
engine.close()
"""


@pytest.mark.timeout(60)
def test_background_threads_leave_the_pinned_core() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    assert len(allowed) >= 2, f"this test needs 2 CPUs to tell pinned from not, has {allowed}"
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(free_port_range(1)), str(allowed[0])],
        capture_output=True,
        text=True,
        timeout=45,
    )
    assert child.returncode == 0, child.stderr
    got = json.loads(child.stdout)
    assert got["main"] == [allowed[0]], got
    for name in ("listener", "sender", "get pool"):
        assert got[name] == allowed, f"the P2P {name} thread runs on CPUs {got[name]}: {got}"
