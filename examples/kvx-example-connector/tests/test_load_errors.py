"""A load that fails says why: the engine only learns which blocks are bad (the request ends
as `finished_error`), so the worker's log is where the cause (here: P's file never came) is."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from kvx import KVTransferConfig, RequestStatus
from kvx.engine import Engine, EngineConfig


def test_failed_load_logs_request_and_cause(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = KVTransferConfig.from_dict(
        {
            "kv_connector": "ExamplePDConnector",
            "kv_role": "kv_consumer",
            "kv_connector_extra_config": {"directory": str(tmp_path), "load_timeout_s": 0.2},
        }
    )
    engine = Engine(EngineConfig(num_blocks=16, kv_transfer_config=config))
    params = {
        "do_remote_prefill": True,
        "remote_engine_id": "absent-prefill",
        "remote_request_id": "never-written",
        "remote_block_ids": [0, 1],
        "remote_num_tokens": 20,
    }
    finished = []
    try:
        engine.add_request("orphan", list(range(20)), 2, params)
        deadline = time.monotonic() + 30
        with caplog.at_level(logging.ERROR, logger="kvx_example_connector.worker"):
            while not finished and time.monotonic() < deadline:
                finished = [out for out in engine.step() if out.finished]
                time.sleep(0.01)
    finally:
        engine.shutdown()
    assert [(out.request_id, out.status) for out in finished] == [
        ("orphan", RequestStatus.FINISHED_ERROR)
    ]
    logged = [r.getMessage() for r in caplog.records]
    assert any(
        "request orphan" in m and "never-written" in m and "did not appear within 0.2s" in m
        for m in logged
    ), logged
