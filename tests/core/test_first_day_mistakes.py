"""The first-day mistakes of issue 19 that the other test files do not already pin down: each is
exit 2 with a message naming the flag or key and the fix, found before anything starts."""

from __future__ import annotations

import json

import pytest

from kvx.cli.commands import main


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--layout", "nhd"],
            "error: argument --layout: 'nhd' is not a registered layout; allowed: ",
        ),
        (["--layout", "nhd"], '(did you mean "NHD"?)'),
        (
            ["--tp", "3:1"],
            "error: argument --tp: '3:1': tp_size=3 does not divide num_kv_heads=4; use a TP "
            "size that divides the heads ([1, 2, 4])",
        ),
        (
            [
                *("--tp", "2:1", "--kv-transfer-config"),
                '{"kv_connector": "OffloadingConnector", '
                '"kv_connector_extra_config": {"cpu_bytes_to_use": 16777216}}',
            ],
            "error: argument --tp: OffloadingConnector does not claim heterogeneous TP; use "
            "equal sizes such as 1:1",
        ),
    ],
)
def test_demo_flags_are_refused_before_any_engine_starts(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    code, out, err = run(capsys, "demo", *args)
    assert code == 2
    assert message in err, err
    assert "invalid KV transfer config" not in err  # a bad flag, not a bad config
    assert "moving KV" not in out and "requests" not in out  # nothing started


def test_localhost_is_a_side_channel_host_as_in_vllm(capsys: pytest.CaptureFixture[str]) -> None:
    config = {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"side_channel_host": "localhost"},
    }
    code, _, err = run(capsys, "validate", "--kv-transfer-config", json.dumps(config))
    assert code == 0, err
    config["kv_connector_extra_config"] = {"side_channel_host": "my-host.example"}
    code, _, err = run(capsys, "validate", "--kv-transfer-config", json.dumps(config))
    assert code == 2
    assert (
        "kv_connector_extra_config.side_channel_host: 'my-host.example' is not an IP address; "
        "use e.g. '127.0.0.1' or 'localhost'" in err
    )


@pytest.mark.parametrize(
    ("preconnect", "message"),
    [
        (["127.0.0.1"], "'127.0.0.1' is not host:port of a P side channel (port 1-65535)"),
        (["127.0.0.1:0"], "'127.0.0.1:0' is not host:port of a P side channel"),
        (["p-host:5600"], "'p-host:5600': 'p-host' is not an IP address"),
        ("127.0.0.1:5600", 'expected a list of a string, got "127.0.0.1:5600" (string)'),
    ],
)
def test_a_bad_preconnect_address_is_named(
    capsys: pytest.CaptureFixture[str], preconnect: object, message: str
) -> None:
    config = {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"preconnect": preconnect},
    }
    code, _, err = run(capsys, "validate", "--kv-transfer-config", json.dumps(config))
    assert code == 2, err
    assert "preconnect" in err and message in err, err
    config["kv_connector_extra_config"] = {"preconnect": ["localhost:5600", "[::1]:5600"]}
    code, _, err = run(capsys, "validate", "--kv-transfer-config", json.dumps(config))
    assert code == 0, err
