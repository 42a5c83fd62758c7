"""A store on a real, nearly full filesystem (a 64 KiB tmpfs): the saves that hit ENOSPC are
counted in the engine's stats and shown in `kvx demo`'s summary; outputs stay identical."""

from __future__ import annotations

import random
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvx.demo import summary_table
from kvx.engine.disagg import DisaggregatedPair, pd_configs
from kvx.engine.engine import EngineConfig

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "tiny"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def test_failed_saves_are_counted_and_shown(full_disk: Path) -> None:
    rng = random.Random(0)
    prompts = {f"r{i}": [rng.randrange(1024) for _ in range(100)] for i in range(4)}
    kv = {
        "kv_connector": "SharedStorageConnector",
        "kv_connector_extra_config": {"storage_url": f"file://{full_disk}/kv"},
    }
    base = EngineConfig(num_layers=4)
    prefill, decode = pd_configs(base, kv)
    pair = DisaggregatedPair(prefill, decode, processes=False)
    try:
        report = pair.run(prompts, 2)
    finally:
        pair.close()
    assert report.all_identical  # D computed what it could not load
    failed = report.prefill_stats["kv_save_errors"]
    assert failed > 0
    rows = dict(zip(*(c._cells for c in summary_table(report, base, "x").columns), strict=True))
    assert rows["KV saves failed"] == str(failed)
