"""A store on a real, nearly full filesystem (a 64 KiB tmpfs): the saves that hit ENOSPC are
counted in the engine's stats, shown in `kvx demo`'s summary and reported as
`BlockStoreFailed` events (storage and offload connectors); outputs stay identical."""

from __future__ import annotations

import random
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvx import BlockRemoved, BlockStoreFailed, KVTransferConfig
from kvx.cli.demo import summary_table
from kvx.engine.disagg import DisaggregatedPair, pd_configs
from kvx.engine.engine import Engine, EngineConfig

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


def test_failed_saves_are_events(full_disk: Path) -> None:
    """Each failed write is a `BlockStoreFailed` event naming its blocks, medium and error."""
    rng = random.Random(1)
    prompts = {f"r{i}": [rng.randrange(1024) for _ in range(100)] for i in range(4)}
    kv = {
        "kv_connector": "SharedStorageConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"storage_url": f"file://{full_disk}/kv"},
    }
    engine = Engine(EngineConfig(num_layers=4, kv_transfer_config=KVTransferConfig.from_dict(kv)))
    try:
        run_engine(engine, prompts)
        assert engine.scheduler_connector is not None
        events = list(engine.scheduler_connector.take_events())
        failed = engine.stats()["kv_save_errors"]
    finally:
        engine.shutdown()
    assert failed > 0 and len(events) == failed, (failed, events)
    for event in events:
        assert isinstance(event, BlockStoreFailed) and event.medium == "DISK"
        assert event.block_hashes and all(isinstance(h, str) for h in event.block_hashes)
        assert "No space left on device" in event.reason, event.reason


def test_failed_spills_to_a_full_disk_tier_are_events(full_disk: Path) -> None:
    """OffloadingConnector: a chunk that could not be written to the disk tier is reported
    (`BlockStoreFailed`, then `BlockRemoved` as its spill was announced), counted, never
    loaded from disk, and leaves no partial file."""
    kv = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "cpu_bytes_to_use": 1 << 16,
            "disk_url": f"file://{full_disk}/disk",
            "disk_bytes_to_use": 1 << 24,  # more than the filesystem has
        },
    }
    config = EngineConfig(num_blocks=24, kv_transfer_config=KVTransferConfig.from_dict(kv))
    engine = Engine(config)
    rng = random.Random(2)
    try:
        first = {f"a{i}": [rng.randrange(1024) for _ in range(100)] for i in range(6)}
        run_engine(engine, first)
        run_engine(engine, {f"again-{k}": v for k, v in first.items()})  # reloads what it can
        assert engine.scheduler_connector is not None
        events = list(engine.scheduler_connector.take_events())
        failed = engine.stats()["kv_save_errors"]
    finally:
        engine.shutdown()
    failures = [e for e in events if isinstance(e, BlockStoreFailed)]
    assert failed > 0 and len(failures) == failed, (failed, failures)
    for failure in failures:
        assert failure.medium == "DISK" and "No space left on device" in failure.reason
        assert BlockRemoved(failure.block_hashes, "DISK") in events
    assert not list((full_disk / "disk").glob("*.tmp"))


def run_engine(engine: Engine, prompts: dict[str, list[int]]) -> None:
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, 2)
    deadline = time.monotonic() + 60
    while engine.has_pending_work():
        assert time.monotonic() < deadline, engine.diagnose()
        engine.step()
        assert engine.check_kv() == []
