"""Fuzz `kvx validate`: thousands of random and mutated configs end in exit 0 or 2 with a
message, never a traceback or an internal error."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvx.cli import commands as cli
from kvx.registry.core import Registry

pytestmark = pytest.mark.timeout(300)

FUZZ = settings(
    max_examples=1000,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

KEYS = [
    "kv_connector",
    "kv_role",
    "engine_id",
    "kv_port",
    "kv_connector_extra_config",
    "kv_connector_module_path",
    "kv_load_failure_policy",
    "kv_buffer_size",
    "kv_rank",
    "connectors",
    "mode",
    "num_threads",
    "tags",
    "storage_path",
    "prefer_first",
    "kv_rloe",
    "",
    "\u00e9",
    "__class__",
]
NAMES = [
    "EchoConnector",
    "TestEcho",
    "CompositeConnector",
    "EchoHMAConnector",
    "NeedsMissingDependency",
    "FutureContractConnector",
    "NotAConnector",
    "Nixl",
    "kv_both",
    "kv_producer",
    "kv_consumer",
    "recompute",
    "fail",
    "async",
    "sync",
    "kvx_test_plugin.connectors",
    "ExternalConnector",
    "TwoArgConnector",
    "os",
    "",
]

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
    | st.sampled_from(NAMES)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=25,
)

VALID: list[dict[str, Any]] = [
    {
        "kv_connector": "EchoConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"mode": "async", "num_threads": 8, "tags": ["a"]},
    },
    {
        "kv_connector": "CompositeConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {
            "connectors": [
                {"kv_connector": "TestEcho", "kv_connector_extra_config": {"mode": "sync"}},
                {"kv_connector": "EchoHMAConnector"},
            ],
            "prefer_first": False,
        },
    },
    {
        "kv_connector": "ExternalConnector",
        "kv_role": "kv_consumer",
        "kv_connector_module_path": "kvx_test_plugin.connectors",
        "kv_load_failure_policy": "recompute",
    },
    {"kv_role": "kv_both", "kv_port": 1234, "kv_ip": "127.0.0.1", "kv_buffer_size": 1e6},
]


@st.composite
def mutated_configs(draw: st.DrawFn) -> Any:
    config = json.loads(json.dumps(draw(st.sampled_from(VALID))))
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        target = config
        # Walk into a random nested object (extra config, a child config, ...).
        for _ in range(draw(st.integers(min_value=0, max_value=3))):
            children = [
                v
                for v in (target.values() if isinstance(target, dict) else target)
                if isinstance(v, (dict, list)) and v
            ]
            if not children:
                break
            target = draw(st.sampled_from(children))
        if isinstance(target, list):
            target[draw(st.integers(0, len(target) - 1))] = draw(json_values)
            continue
        action = draw(st.sampled_from(["delete", "set", "rename"]))
        if action == "delete" and target:
            del target[draw(st.sampled_from(sorted(target)))]
        elif action == "rename" and target:
            key = draw(st.sampled_from(sorted(target)))
            target[key[:-1] + draw(st.text(max_size=2))] = target.pop(key)
        else:
            target[draw(st.sampled_from(KEYS))] = draw(json_values)
    return config


def validate(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["validate", f"--kv-transfer-config={text}"])
    out, err = capsys.readouterr()
    assert code in (0, 2), f"exit {code} for {text!r}: {err}"
    assert "Traceback" not in err and "internal error" not in err
    if code == 0:
        assert isinstance(json.loads(out), dict)
    else:
        assert out == ""
        assert err.startswith("error: "), err


@FUZZ
@given(config=mutated_configs())
def test_mutated_valid_configs(
    plugin_registry: Registry, capsys: pytest.CaptureFixture[str], config: Any
) -> None:
    validate(json.dumps(config), capsys)


@FUZZ
@given(value=json_values)
def test_random_json_values(
    plugin_registry: Registry, capsys: pytest.CaptureFixture[str], value: Any
) -> None:
    validate(json.dumps(value), capsys)


@settings(
    max_examples=500,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(text=st.text(max_size=60) | st.binary(max_size=40).map(lambda b: b.decode("latin-1")))
def test_random_text(
    plugin_registry: Registry, capsys: pytest.CaptureFixture[str], text: str
) -> None:
    validate(text, capsys)


def test_deeply_nested_json_is_an_error_not_a_crash(
    plugin_registry: Registry, capsys: pytest.CaptureFixture[str]
) -> None:
    validate("[" * 100_000 + "]" * 100_000, capsys)
    validate('{"kv_connector_extra_config": ' * 3000 + "{}" + "}" * 3000, capsys)
