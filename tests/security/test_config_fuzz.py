"""10,000 seeded mutations of every built-in connector's config, each through `kvx validate`
in process (exit 0 or 2, nothing else, agreeing with parsing the config), validation and
construction of both roles (nothing but `ConfigError`). Each mutation draws field values
from a catalogue of known-good and known-bad values, so the test also knows the answer: a
config holding a bad value must be refused (at validation or at construction) and one holding
only good values must be built."""

from __future__ import annotations

import contextlib
import io
import json
import random
from pathlib import Path
from typing import Any

import pytest

from kvx import (
    ConfigError,
    EngineContext,
    KVCacheSpec,
    KVConnectorRole,
    KVTransferConfig,
    cli,
    create_connector,
)

MUTATIONS = 10_000
CTX = EngineContext(
    engine_id="e",
    model_name="m",
    cache=KVCacheSpec(("l0",), num_kv_heads=2, head_size=8, block_size=16),
)
JUNK = [None, True, -1, 2**64, 1.5, "", "x", [], {}, [1], {"a": 1}, "\x00", "\ud800"]


def catalogue(tmp: Path) -> dict[str, dict[str, tuple[list[Any], list[Any]]]]:
    """Per connector, per extra-config field: (good values, bad values). A `None` good value
    leaves the field out."""
    long_name = "a" * 300
    return {
        "SharedStorageConnector": {
            "storage_url": (
                ["memory://fuzz", f"file://{tmp}/store"],
                [
                    "file:///",
                    f"file://{tmp}/a\x00b",
                    f"file://{tmp}/\ud800",
                    f"file://{tmp}/{long_name}",
                    "redis://127.0.0.1:99999/0",
                    "redis://127.0.0.1:1/0",  # nobody listens: refused at construction
                    "gcs://bucket/kv",  # gcsfs is not installed: refused at construction
                    f"file:///proc/kvx-{tmp.name}",  # cannot be created
                    "no-scheme",
                ],
            ),
            "storage_block_size": ([None, 16, 32], [0, 24, 2**64, 1.5]),
            "io_threads": ([None, 1, 4], [0, 65]),
            "timeout_s": ([None, 1.0], [0, -1, 1e400]),
            "namespace": ([None, "ns.1"], ["a/b", "", long_name]),
            "verify_checksums": ([None, True], ["yes"]),  # false and integrity "mac" conflict
            "max_inflight_bytes": ([None, 1 << 20], [0]),
            "permissions": ([None, "owner", "group"], ["world"]),
            "mac": (  # integrity and mac_secret go together
                [None, ("mac", "0123456789abcdef")],
                [("mac", None), ("mac", "short"), (None, "0123456789abcdef"), ("hmac", None)],
            ),
        },
        "OffloadingConnector": {
            "cpu_bytes_to_use": ([1 << 20], [0, 10, 2**64, 1 << 49, 1e400, "1"]),
            "block_size": ([None, 32], [24, 2**64]),
            "eviction_policy": ([None, "lru", "arc"], ["fifo"]),
            "disk": (  # disk_url and disk_bytes_to_use go together
                [None, (f"file://{tmp}/disk", 1 << 20)],
                [
                    (f"file://{tmp}/disk", None),
                    (None, 1 << 20),
                    ("file:///", 1 << 20),
                    (f"file://{tmp}/\x00", 1 << 20),
                    (f"file://{tmp}/disk", 10),
                ],
            ),
        },
        "NixlConnector": {
            "side_channel_host": ([None, "127.0.0.1"], ["example.com", "198.51.100.77"]),
            # few good values: every distinct good config builds a NIXL agent (~0.1 s)
            "side_channel_port": ([None], [-1, 70000]),
            "kv_lease_duration": ([None], [0, 1e400]),
            "backends": ([None], [[], ["FOO"]]),
            "shared_secret": ([None, "0123456789"], ["short"]),
            "max_handshake_bytes": ([None], [10]),
        },
        "P2pNcclConnector": {
            # few good values: every distinct good config is built once (~0.1 s each)
            "send_type": ([None, "GET"], ["put", "PUSH", 1]),
            "data_plane": ([None], ["gpu", ""]),
            "default_decode_address": (
                [None, "[::1]:5000"],
                ["127.0.0.1", "host:0", "a_b:1", "x:99999", "[zz]:1", 5000],
            ),
            "mem_pool_size_gb": ([None], [-1, 1e400]),
            "transfer_timeout_s": ([None], [0, -1]),
            "shared_secret": ([None], ["short"]),
            "max_tensor_bytes": ([None], [10, 2**64]),
            "proxy": (  # proxy_ip, proxy_port and http_port go together
                [None, ("127.0.0.1", 30001, 8000)],
                [("127.0.0.1", None, 8000), ("127.0.0.1", 30001, None), (None, 30001, None)],
            ),
        },
        "ExamplePDConnector": {
            "directory": ([str(tmp / "handoff")], ["", f"{tmp}/\x00", f"{tmp}/{long_name}"]),
            "load_timeout_s": ([None, 5.0], [0, -2]),
        },
    }


TOP: dict[str, tuple[list[Any], list[Any]]] = {
    "kv_role": (["kv_both", "kv_producer", "kv_consumer"], ["", "both", 1]),
    "kv_port": ([None, 0, 65535], [-1, 65536, "1"]),
    "kv_load_failure_policy": ([None, "recompute", "fail"], ["retry"]),
    "kv_buffer_size": ([None, 0, 1e9], [-1, 1e400]),
}


PAIRS = {"disk": ("disk_url", "disk_bytes_to_use"), "mac": ("integrity", "mac_secret")}


def _set(extra: dict[str, Any], field: str, value: Any) -> None:
    if field in PAIRS:
        if value is not None:
            for key, item in zip(PAIRS[field], value, strict=True):
                if item is not None:
                    extra[key] = item
    elif field == "proxy":
        if value is not None:
            for key, item in zip(("proxy_ip", "proxy_port", "http_port"), value, strict=True):
                if item is not None:
                    extra[key] = item
    elif value is not None:
        extra[field] = value


def mutation(rng: random.Random, cat: dict, depth: int = 0) -> tuple[dict[str, Any], bool]:
    """A config and whether it is bad."""
    name = rng.choice([*cat, "MultiConnector"] if depth == 0 else list(cat))
    bad = False
    if name == "MultiConnector":
        children, extra = [], {}
        for _ in range(rng.randrange(1, 3)):
            child, child_bad = mutation(rng, cat, depth + 1)
            children.append(child)
            bad |= child_bad
        extra["connectors"] = children
        if rng.random() < 0.05:
            extra["connectors"] = rng.choice([[], "x"])
            bad = True
    else:
        extra = {}
        for field, (good, wrong) in cat[name].items():
            use_bad = rng.random() < 0.12
            _set(extra, field, rng.choice(wrong if use_bad else good))
            bad |= use_bad
    config: dict[str, Any] = {"kv_connector": name, "kv_connector_extra_config": extra}
    for field, (good, wrong) in TOP.items():
        if field == "kv_role" and depth:  # children inherit the parent's role
            continue
        use_bad = rng.random() < 0.03
        if use_bad or rng.random() < 0.5:
            value = rng.choice(wrong if use_bad else good)
            if value is not None:
                config[field] = value
            bad |= use_bad
    if not depth:
        config.setdefault("kv_role", "kv_both")
    if rng.random() < 0.05:  # junk: an unknown key, at the top or in the extra config
        target = extra if rng.random() < 0.5 else config
        target[rng.choice(["unknown_key", "kv_rloe", "storage-url", ""])] = rng.choice(JUNK)
        bad = True
    return config, bad


def build(config: KVTransferConfig) -> None:
    """Construct both roles (and shut them down)."""
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        create_connector(config, role, CTX).shutdown()


@pytest.mark.timeout(120)
def test_config_mutations(tmp_path: Path) -> None:
    cat = catalogue(tmp_path)
    rng = random.Random(2026)
    built: dict[str, str] = {}  # connector + extra config -> "ok" / why it was refused
    accepted_bad, refused_good, disagree = [], [], []
    outcomes = {True: 0, False: 0}
    codes: dict[int, int] = {}
    for _ in range(MUTATIONS):
        data, bad = mutation(rng, cat)
        text = json.dumps(data)
        # every mutation through `kvx validate` itself, in process
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            code = cli.main(["validate", "--kv-transfer-config", text])
        codes[code] = codes.get(code, 0) + 1
        try:
            config = KVTransferConfig.from_json(text)
        except ConfigError as exc:
            outcome = f"refused: {exc}"
            if code != 2:
                disagree.append(f"{text}: validate exit {code}, parsing refused it")
        else:
            if code != 0:
                disagree.append(f"{text}: validate exit {code}, parsing accepted it")
            # construction depends on the connector and its extra config only: built once
            key = json.dumps([config.kv_connector, config.kv_connector_extra_config])
            if key not in built:
                try:
                    build(config)
                    built[key] = "ok"
                except ConfigError as exc:
                    built[key] = f"refused: {exc}"
            outcome = built[key]
        outcomes[outcome == "ok"] += 1
        if bad and outcome == "ok":
            accepted_bad.append(text)
        if not bad and outcome != "ok":
            refused_good.append(f"{text} -> {outcome}")
    assert set(codes) <= {0, 2}, codes
    assert not disagree, disagree[:3]
    assert not accepted_bad, accepted_bad[:3]
    assert not refused_good, refused_good[:3]
    assert outcomes[True] > 2000 and outcomes[False] > 2000, outcomes  # both are exercised
