"""Tests marked `needs_cuda` (the NCCL data plane) run wherever two CUDA devices and libnccl
are present. Elsewhere they are collected, reported as skipped with the reason, and counted
and named in a section of the summary: never a silent pass."""

from __future__ import annotations

from typing import Any

import pytest

REASON = "NOT RUN: needs CUDA (2 devices and libnccl) for the NCCL data plane"


def cuda_pair_available() -> bool:
    try:
        import torch

        from kvx.plugins.p2p.nccl import load_nccl

        if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
            return False
        load_nccl()
    except Exception:
        return False
    return True


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    marked = [item for item in items if item.get_closest_marker("needs_cuda")]
    if marked and not cuda_pair_available():
        for item in marked:
            item.add_marker(pytest.mark.skip(reason=REASON))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    not_run = [
        report.nodeid
        for report in terminalreporter.stats.get("skipped", [])
        if REASON in str(getattr(report, "longrepr", ""))
    ]
    if not_run:
        terminalreporter.write_sep("=", f"{len(not_run)} NCCL tests NOT RUN (no CUDA here)")
        for nodeid in not_run:
            terminalreporter.write_line(f"NOT RUN (needs CUDA): {nodeid}")
