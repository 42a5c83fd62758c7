"""`integrity: "mac"`: stored values carry a keyed MAC, so a value planted by someone who can
write to the store but lacks `mac_secret` (here: written by an engine configured without it,
or with another secret, into the same real directory) is refused at load: a load error, and
the engine recomputes the exact same tokens. Engines sharing the secret load each other's
values. Both IO paths: values straight from the KV cache (native file IO is bypassed, as it
only computes checksums) and values converted to another block size (sealed in buffers)."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvx import ConfigError, KVTransferConfig
from kvx.engine.disagg import baseline_tokens
from kvx.engine.engine import Engine, EngineConfig

pytestmark = pytest.mark.timeout(120)
BASE = EngineConfig(num_layers=2, num_kv_heads=4, head_size=16)
SECRET = "0123456789abcdef-secret"
MAC = {"integrity": "mac", "mac_secret": SECRET}


def run(url: str, extra: dict[str, Any]) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Tokens of three prompts on one engine, and its stats (every KV byte checked)."""
    ktc = KVTransferConfig.from_dict(
        {
            "kv_connector": "SharedStorageConnector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"storage_url": url, **extra},
        }
    )
    engine = Engine(replace(BASE, kv_transfer_config=ktc))
    rng = random.Random(3)
    prompts = {
        f"r{i}": [rng.randrange(BASE.vocab_size) for _ in range(n)] for i, n in enumerate((40, 70))
    }
    try:
        for rid, prompt in prompts.items():
            engine.add_request(rid, prompt, 3)
        done: dict[str, list[int]] = {}
        for _ in range(500):
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.output_token_ids
            assert not engine.check_kv()
            if not engine.has_pending_work():
                break
        stats = engine.stats()
    finally:
        engine.shutdown()
    assert done == baseline_tokens(BASE, prompts, 3)
    return done, stats


@pytest.mark.parametrize("block_size", [None, 32], ids=["direct", "converted"])
def test_values_without_the_key_are_refused(tmp_path: Path, block_size: int | None) -> None:
    url = f"file://{tmp_path}/kv"
    sizes = {} if block_size is None else {"storage_block_size": block_size}
    _, planted = run(url, sizes)  # no MAC: as someone without the secret would write
    assert planted["external_tokens"] == 0 and planted["load_errors"] == 0
    _, refused = run(url, {**sizes, **MAC})
    assert refused["load_errors"] > 0  # every planted value is refused, then recomputed
    # the MAC engine stored its own values over the refused ones: a holder of the key loads them
    _, loaded = run(url, {**sizes, **MAC})
    assert loaded["external_tokens"] > 0 and loaded["load_errors"] == 0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"integrity": "mac"}, 'mac_secret: integrity "mac" needs a secret of at least 16'),
        ({"integrity": "mac", "mac_secret": "short"}, "at least 16 characters"),
        ({"mac_secret": SECRET}, 'mac_secret: only used with integrity "mac"'),
        ({**MAC, "verify_checksums": False}, 'integrity "mac" always verifies'),
        ({"integrity": "hmac"}, "integrity"),
    ],
)
def test_mac_config_errors_name_the_field(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        KVTransferConfig.from_dict(
            {
                "kv_connector": "SharedStorageConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"storage_url": "memory://mac", **extra},
            }
        )
    assert message in str(info.value)
