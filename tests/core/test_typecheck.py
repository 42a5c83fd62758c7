"""The type checker sees plugins under their import names: a bad call inside one is reported."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
from kvx.layouts import get_layout
from kvx.plugins.storage.backends.base import StorageBackend
from kvx.plugins.storage.worker import StorageWorker


def probe(backend: StorageBackend, worker: StorageWorker) -> None:
    reveal_type(StorageBackend)
    reveal_type(get_layout)
    reveal_type(worker.backend)
    backend.no_such_method()
"""


@pytest.mark.timeout(600)
def test_bad_call_inside_a_plugin_is_reported(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    # A line naming this run's file: mypy's cache must not replay an earlier run's messages.
    probe.write_text(f"{PROBE}\n# {probe}\n", encoding="utf-8")
    result = subprocess.run(
        [sys.executable, "tools/typecheck.py", f"kvx.plugins.storage._probe={probe}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=580,
        check=False,
    )
    out = result.stdout
    revealed = [line for line in out.splitlines() if "Revealed type is" in line]
    assert len(revealed) == 3, out + result.stderr
    for line in revealed:  # the storage protocol, the layout lookup, the worker's backend
        assert "Any" not in line and ("StorageBackend" in line or "Layout" in line), line
    assert re.search(
        rf'^{re.escape(str(probe))}:11: error: .* no attribute "no_such_method"', out, re.M
    ), out
    assert result.returncode == 1
