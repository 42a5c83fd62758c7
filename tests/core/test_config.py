"""KVTransferConfig: vLLM's rules, kvx's strict validation and every error message."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from kvx import ConfigError, KVTransferConfig
from kvx.registry.core import Registry


def problems_of(data: object, registry: Registry) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        KVTransferConfig.from_dict(data, registry=registry)
    return {p.path: p.message for p in info.value.problems}


def echo(**extra: object) -> dict[str, object]:
    return {
        "kv_connector": "EchoConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


# -- vLLM's rules ---------------------------------------------------------------------------


def test_connector_without_role_is_refused(plugin_registry: Registry) -> None:
    found = problems_of({"kv_connector": "EchoConnector"}, plugin_registry)
    assert found == {
        "kv_role": 'required when kv_connector is set ("EchoConnector"); '
        'allowed: "kv_producer", "kv_consumer", "kv_both"'
    }


def test_programmatic_construction_applies_the_same_rules() -> None:
    with pytest.raises(ValueError, match="kv_role: required when kv_connector is set"):
        KVTransferConfig(kv_connector="EchoConnector")
    with pytest.raises(ValueError, match=r'kv_role: "producer" .* \(did you mean "kv_producer"'):
        KVTransferConfig(kv_role="producer")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match='kv_load_failure_policy: "retry"'):
        KVTransferConfig(kv_load_failure_policy="retry")  # type: ignore[arg-type]


def test_invalid_role_names_value_allowed_values_and_suggestion(plugin_registry: Registry) -> None:
    found = problems_of({"kv_connector": "EchoConnector", "kv_role": "kv_consmer"}, plugin_registry)
    assert found == {
        "kv_role": '"kv_consmer" (string) is not allowed; allowed: "kv_both", '
        '"kv_consumer", "kv_producer" (did you mean "kv_consumer"?)'
    }


def test_role_without_connector_is_allowed_and_not_a_transfer_instance() -> None:
    config = KVTransferConfig.from_dict({"kv_role": "kv_producer"}, check_extra=False)
    assert config.kv_role == "kv_producer"
    assert not config.is_kv_transfer_instance
    assert not config.is_kv_producer


def test_engine_id_is_a_fresh_uuid_unless_given(plugin_registry: Registry) -> None:
    first = KVTransferConfig.from_dict(echo(), registry=plugin_registry)
    second = KVTransferConfig.from_dict(echo(), registry=plugin_registry)
    assert first.engine_id is not None and second.engine_id is not None
    assert uuid.UUID(first.engine_id).version == 4
    assert first.engine_id != second.engine_id
    assert KVTransferConfig(engine_id="prefill-0").engine_id == "prefill-0"


@pytest.mark.parametrize(
    ("role", "producer", "consumer"),
    [("kv_producer", True, False), ("kv_consumer", False, True), ("kv_both", True, True)],
)
def test_role_properties(
    plugin_registry: Registry, role: str, producer: bool, consumer: bool
) -> None:
    config = KVTransferConfig.from_dict(
        {"kv_connector": "EchoConnector", "kv_role": role}, registry=plugin_registry
    )
    assert config.is_kv_transfer_instance
    assert (config.is_kv_producer, config.is_kv_consumer) == (producer, consumer)


def test_defaults_match_vllm() -> None:
    config = KVTransferConfig()
    assert config.kv_load_failure_policy == "fail"
    assert config.kv_port == 14579
    assert config.kv_connector_extra_config == {}
    assert config.enable_permute_local_kv is False
    assert config.kv_connector_module_path is None
    assert len(config.compute_hash()) == 64


def test_recompute_policy_is_accepted(plugin_registry: Registry) -> None:
    data = {**echo(), "kv_load_failure_policy": "recompute"}
    assert KVTransferConfig.from_dict(data, registry=plugin_registry).kv_load_failure_policy == (
        "recompute"
    )
    found = problems_of({**echo(), "kv_load_failure_policy": "recompte"}, plugin_registry)
    assert found == {
        "kv_load_failure_policy": '"recompte" (string) is not allowed; allowed: '
        '"fail", "recompute" (did you mean "recompute"?)'
    }


def test_legacy_fields_are_accepted(plugin_registry: Registry) -> None:
    data = {
        **echo(),
        "kv_buffer_size": 5e9,
        "kv_rank": 1,
        "kv_parallel_size": 2,
        "kv_ip": "127.0.0.2",
    }
    config = KVTransferConfig.from_dict(data, registry=plugin_registry)
    assert (config.kv_buffer_size, config.kv_rank, config.kv_parallel_size, config.kv_ip) == (
        5e9,
        1,
        2,
        "127.0.0.2",
    )


def test_get_from_extra_config_and_has_connector(plugin_registry: Registry) -> None:
    config = KVTransferConfig.from_dict(echo(mode="async"), registry=plugin_registry)
    assert config.get_from_extra_config("mode", "x") == "async"
    assert config.get_from_extra_config("absent", 7) == 7
    assert config.has_connector("EchoConnector")
    multi = KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"connectors": [{"kv_connector": "NixlConnector"}]},
    )
    assert multi.has_connector("NixlConnector")
    assert not multi.has_connector("LMCacheConnectorV1")


# -- strict validation ------------------------------------------------------------------------


def test_unknown_top_level_key_gets_did_you_mean(plugin_registry: Registry) -> None:
    found = problems_of({**echo(), "kv_rloe": "kv_both"}, plugin_registry)
    assert list(found) == ["kv_rloe"]
    assert found["kv_rloe"].startswith('unknown key (did you mean "kv_role"?); allowed keys: ')
    assert '"kv_load_failure_policy"' in found["kv_rloe"]


def test_type_errors_name_expected_type_and_value(plugin_registry: Registry) -> None:
    found = problems_of(
        {
            **echo(),
            "kv_port": "14579",
            "enable_permute_local_kv": 1,
            "kv_connector_extra_config": [],
        },
        plugin_registry,
    )
    assert found == {
        "kv_port": 'expected an integer >= 0 and <= 65535, got "14579" (string)',
        "enable_permute_local_kv": "expected true or false, got 1 (integer)",
        "kv_connector_extra_config": "expected an object of any value, got [] (array)",
    }


def test_out_of_range_port(plugin_registry: Registry) -> None:
    assert problems_of({**echo(), "kv_port": 70000}, plugin_registry) == {
        "kv_port": "70000 (integer) is out of range; allowed: an integer >= 0 and <= 65535"
    }


def test_every_problem_is_reported_at_once(plugin_registry: Registry) -> None:
    found = problems_of(
        {
            "kv_connector": "EchoConnector",
            "kv_port": -1,
            "bogus": 1,
            "kv_connector_extra_config": {"num_threads": 0, "mdoe": "sync"},
        },
        plugin_registry,
    )
    assert set(found) == {
        "kv_role",
        "kv_port",
        "bogus",
        "kv_connector_extra_config.num_threads",
        "kv_connector_extra_config.mdoe",
    }


def test_unknown_connector_gets_did_you_mean_and_known_names(plugin_registry: Registry) -> None:
    found = problems_of({"kv_connector": "EchoConector", "kv_role": "kv_both"}, plugin_registry)
    message = found["kv_connector"]
    assert message.startswith(
        '"EchoConector" is not a registered connector (did you mean "EchoConnector"?); known: '
    )
    assert '"TestEcho"' in message and "kv_connector_module_path" in message


def test_empty_connector_name_and_module_path_are_refused(plugin_registry: Registry) -> None:
    found = problems_of({**echo(), "kv_connector_module_path": ""}, plugin_registry)
    assert found == {
        "kv_connector_module_path": '"" (string) is not allowed; give an '
        "importable module path or leave it out"
    }
    found = problems_of({"kv_connector": "", "kv_role": "kv_both"}, plugin_registry)
    assert found == {"kv_connector": '"" (string) is not allowed; give a connector name'}


# -- connector extra config --------------------------------------------------------------------


def test_extra_config_is_normalised_with_schema_defaults(plugin_registry: Registry) -> None:
    config = KVTransferConfig.from_dict(echo(mode="async"), registry=plugin_registry)
    assert config.kv_connector_extra_config == {
        "storage_path": "/tmp/echo",
        "num_threads": 4,
        "mode": "async",
        "tags": [],
    }


def test_extra_config_unknown_key_did_you_mean(plugin_registry: Registry) -> None:
    found = problems_of(echo(num_thread=2), plugin_registry)
    assert found == {
        "kv_connector_extra_config.num_thread": (
            'unknown key (did you mean "num_threads"?); allowed keys: "mode", '
            '"num_threads", "storage_path", "tags"'
        )
    }


def test_extra_config_types_ranges_and_literals(plugin_registry: Registry) -> None:
    found = problems_of(
        echo(num_threads=100, mode="asnyc", tags=["a", 3], storage_path=None), plugin_registry
    )
    assert found == {
        "kv_connector_extra_config.num_threads": (
            "100 (integer) is out of range; allowed: an integer >= 1 and <= 64"
        ),
        "kv_connector_extra_config.mode": (
            '"asnyc" (string) is not allowed; allowed: "async", "sync" (did you mean "async"?)'
        ),
        "kv_connector_extra_config.tags[1]": "expected a string, got 3 (integer)",
        "kv_connector_extra_config.storage_path": "expected a string, got null (null)",
    }


def test_connector_without_schema_takes_no_extra_keys(plugin_registry: Registry) -> None:
    data = {
        "kv_connector": "EchoHMAConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"anything": 1},
    }
    assert problems_of(data, plugin_registry) == {
        "kv_connector_extra_config.anything": (
            "unknown key; EchoHMAConnector takes no extra config keys"
        )
    }


def test_alias_resolves_for_validation(plugin_registry: Registry) -> None:
    data = {
        "kv_connector": "TestEcho",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"mode": "async"},
    }
    config = KVTransferConfig.from_dict(data, registry=plugin_registry)
    assert config.kv_connector == "TestEcho"
    assert config.kv_connector_extra_config["num_threads"] == 4


def composite(*children: object, **extra: object) -> dict[str, object]:
    return {
        "kv_connector": "CompositeConnector",
        "kv_role": "kv_producer",
        "engine_id": "eng-1",
        "kv_connector_extra_config": {"connectors": list(children), **extra},
    }


def test_nested_child_configs_are_validated_recursively(plugin_registry: Registry) -> None:
    data = composite(
        {"kv_connector": "EchoConnector", "kv_connector_extra_config": {"num_threads": "8"}},
        {"kv_connector": "EchoConnector", "kv_role": "decoder"},
        {"kv_connector": "EchoConector"},
        {"kv_conector": "EchoConnector"},
        prefer_frist=True,
    )
    found = problems_of(data, plugin_registry)
    base = "kv_connector_extra_config"
    assert found[f"{base}.connectors[0].kv_connector_extra_config.num_threads"] == (
        'expected an integer >= 1 and <= 64, got "8" (string)'
    )
    assert found[f"{base}.connectors[1].kv_role"] == (
        '"decoder" (string) is not allowed; allowed: "kv_both", "kv_consumer", "kv_producer"'
    )
    assert '(did you mean "EchoConnector"?)' in found[f"{base}.connectors[2].kv_connector"]
    assert found[f"{base}.connectors[3].kv_conector"].startswith(
        'unknown key (did you mean "kv_connector"?)'
    )
    assert found[f"{base}.prefer_frist"].startswith('unknown key (did you mean "prefer_first"?)')
    assert found[f"{base}.connectors[3].kv_connector"].startswith("a child connector needs")
    assert len(found) == 6


def test_nested_children_inherit_engine_id_and_role(plugin_registry: Registry) -> None:
    data = composite(
        {"kv_connector": "EchoConnector"},
        {"kv_connector": "EchoHMAConnector", "engine_id": "own", "kv_role": "kv_both"},
    )
    config = KVTransferConfig.from_dict(data, registry=plugin_registry)
    first, second = config.kv_connector_extra_config["connectors"]
    assert (first["engine_id"], first["kv_role"]) == ("eng-1", "kv_producer")
    assert first["kv_connector_extra_config"]["num_threads"] == 4
    assert (second["engine_id"], second["kv_role"]) == ("own", "kv_both")
    assert config.kv_connector_extra_config["prefer_first"] is True


def test_composite_needs_a_non_empty_children_list(plugin_registry: Registry) -> None:
    found = problems_of(composite(), plugin_registry)
    assert found == {
        "kv_connector_extra_config.connectors": (
            "expected a non-empty list of connector configs, got [] (array)"
        )
    }
    found = problems_of(composite("EchoConnector"), plugin_registry)
    assert found == {
        "kv_connector_extra_config.connectors[0]": (
            'expected a JSON object, got "EchoConnector" (string)'
        )
    }


# -- module path -----------------------------------------------------------------------------


def test_module_path_config_is_checked_against_the_module(plugin_registry: Registry) -> None:
    ok = {
        "kv_connector": "ExternalConnector",
        "kv_role": "kv_both",
        "kv_connector_module_path": "kvx_test_plugin.connectors",
        "kv_connector_extra_config": {"free": "form"},
    }
    config = KVTransferConfig.from_dict(ok, registry=plugin_registry)
    assert config.kv_connector_extra_config == {"free": "form"}
    found = problems_of(
        {**ok, "kv_connector_module_path": "kvx_test_plugin.nowhere"}, plugin_registry
    )
    assert "cannot import 'kvx_test_plugin.nowhere'" in found["kv_connector_module_path"]
    found = problems_of({**ok, "kv_connector": "Missing"}, plugin_registry)
    assert (
        "'kvx_test_plugin.connectors' has no attribute 'Missing'"
        in found["kv_connector_module_path"]
    )


def test_registered_class_by_module_path_gets_its_registered_schema(
    plugin_registry: Registry,
) -> None:
    """A registered connector's class loaded by module path (it declares no schema itself) is
    checked against the schema it is registered with, as when named."""
    by_path = {
        **echo(mode="async"),
        "kv_connector_module_path": "kvx_test_plugin.connectors",
    }
    config = KVTransferConfig.from_dict(by_path, registry=plugin_registry)
    assert config.kv_connector_extra_config["mode"] == "async"
    found = problems_of({**by_path, **echo(mood="async")}, plugin_registry)
    assert found["kv_connector_extra_config.mood"].startswith('unknown key (did you mean "mode"?)')


# -- parsing ----------------------------------------------------------------------------------


def test_parse_json_string_and_file(plugin_registry: Registry, tmp_path: Path) -> None:
    text = json.dumps(echo(mode="async"))
    assert KVTransferConfig.from_json(text, registry=plugin_registry).kv_connector == (
        "EchoConnector"
    )
    path = tmp_path / "kv.json"
    path.write_text(text)
    config = KVTransferConfig.from_cli(f"@{path}", registry=plugin_registry)
    assert config.kv_connector_extra_config["mode"] == "async"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"kv_role": ', "not valid JSON: Expecting value at line 1 column 13"),
        ("[1, 2]", "expected a JSON object, got [1, 2] (array)"),
        ('{"kv_buffer_size": NaN}', "not valid JSON: NaN is not valid JSON"),
        ("", "not valid JSON: Expecting value at line 1 column 1"),
    ],
)
def test_parse_errors(plugin_registry: Registry, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        KVTransferConfig.from_cli(text, registry=plugin_registry)
    assert [p.message for p in info.value.problems] == [message]


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError,
        match=r"cannot read config file .*absent\.json.*"
        r"FileNotFoundError",
    ):
        KVTransferConfig.from_cli(f"@{tmp_path / 'absent.json'}")


def test_round_trip_through_json(plugin_registry: Registry) -> None:
    config = KVTransferConfig.from_dict(echo(tags=["x"]), registry=plugin_registry)
    again = KVTransferConfig.from_json(config.to_json(), registry=plugin_registry)
    assert again == config
