"""Run a benchmark's child process to completion and report its peak resident memory.

`subprocess.run` reaps the child without its resource usage; here the child is reaped with
`os.wait4`, whose `ru_maxrss` is that child's peak RSS (and its own children's, if larger).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class Finished:
    returncode: int
    stdout: str
    stderr: str
    peak_rss: int  # bytes
    timed_out: bool


def run_measured(argv: list[str], timeout: float) -> Finished:
    """Run `argv`, killing it after `timeout` seconds (then `timed_out`)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err)
        expired = threading.Event()

        def kill() -> None:
            expired.set()
            proc.kill()

        timer = threading.Timer(timeout, kill)
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
        out.seek(0)
        err.seek(0)
        return Finished(
            proc.returncode,
            out.read().decode(errors="replace"),
            err.read().decode(errors="replace"),
            usage.ru_maxrss * 1024,  # KiB on Linux
            expired.is_set(),
        )
