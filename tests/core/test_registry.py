"""The plugin registry, exercised through a real third-party package installed with pip."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

import kvx
from kvx import (
    ConnectorSpec,
    EngineContext,
    KVCacheSpec,
    KVConnectorRole,
    KVTransferConfig,
    MissingDependencyError,
    RegistryError,
    create_connector,
)
from kvx.registry.core import Registry

CTX = EngineContext(
    engine_id="e0",
    model_name="tiny",
    cache=KVCacheSpec(layer_names=("layer.0",), num_kv_heads=2, head_size=4, block_size=16),
)

FAKE_HINT = kvx.install_hint("fake-extra", "x")  # for the way kvx is installed here


def run_python(code: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_entry_point_discovery_names_source_distribution(plugin_registry: Registry) -> None:
    echo = plugin_registry.connector("EchoConnector")
    assert echo.source == "kvx-test-plugin 0.0.1"
    assert echo.plugin == "kvx_test_plugin"
    assert echo.spec.summary == "does nothing, answers every hook"
    assert plugin_registry.layout("TEST_LAYOUT").source == "kvx-test-plugin 0.0.1"
    with pytest.raises(RegistryError, match="resolves to str, which is not a layout"):
        plugin_registry.get_layout("TEST_LAYOUT")  # its target was imported, then refused
    assert plugin_registry.load_transform("test_identity")(5) == 5
    backend = plugin_registry.storage_backend_for_url("testmem://bucket/key")
    assert backend.name == "testmem"


@pytest.mark.timeout(60)
def test_connector_module_is_imported_only_on_first_use(plugin_env: Path) -> None:
    result = run_python("""
        import sys
        from kvx import KVTransferConfig
        from kvx.registry.core import get_registry
        registry = get_registry()
        assert "EchoConnector" in registry.connectors()
        KVTransferConfig.from_dict({"kv_connector": "EchoConnector", "kv_role": "kv_both",
                                    "kv_connector_extra_config": {"mode": "async"}})
        print("schemas", "kvx_test_plugin.schemas" in sys.modules)
        print("before", "kvx_test_plugin.connectors" in sys.modules)
        registry.load_connector_class("EchoConnector")
        print("after", "kvx_test_plugin.connectors" in sys.modules)
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:3] == ["schemas True", "before False", "after True"]


def test_missing_declared_dependency_names_the_extra(plugin_registry: Registry) -> None:
    entry = plugin_registry.connector("NeedsMissingDependency")
    assert entry.missing() == ["kvx_test_never_installed_dependency"]
    assert entry.install_hint() == FAKE_HINT
    with pytest.raises(MissingDependencyError) as info:
        plugin_registry.load_connector_class("NeedsMissingDependency")
    assert str(info.value) == (
        "connector 'NeedsMissingDependency' needs 'kvx_test_never_installed_dependency', which "
        f"is not installed: {FAKE_HINT}"
    )


def test_missing_import_inside_module_names_the_extra(plugin_registry: Registry) -> None:
    with pytest.raises(MissingDependencyError) as info:
        plugin_registry.load_connector_class("ImportsMissingDependency")
    assert str(info.value) == (
        "connector 'ImportsMissingDependency' needs 'kvx_test_never_installed_dependency', "
        f"which is not installed: {FAKE_HINT}"
    )
    assert isinstance(info.value, ImportError)


def test_alias_loads_the_same_class(plugin_registry: Registry) -> None:
    assert plugin_registry.connector("TestEcho").name == "EchoConnector"
    assert plugin_registry.load_connector_class("TestEcho") is plugin_registry.load_connector_class(
        "EchoConnector"
    )


def test_unknown_name_suggests_and_lists(plugin_registry: Registry) -> None:
    with pytest.raises(
        RegistryError,
        match=r"'EchoConector' is not a registered connector "
        r"\(did you mean \"EchoConnector\"\?\); known: ",
    ):
        plugin_registry.connector("EchoConector")


def test_module_path_wins_over_registry(plugin_registry: Registry) -> None:
    from kvx_test_plugin import connectors

    class Impostor:
        @kvx.hookimpl
        def kvx_connectors(self) -> list[ConnectorSpec]:
            return [
                ConnectorSpec(
                    name="ExternalConnector", target="kvx_test_plugin.connectors:EchoConnector"
                )
            ]

    plugin_registry.register_plugin(Impostor(), name="impostor")
    plain = KVTransferConfig(kv_connector="ExternalConnector", kv_role="kv_both")
    assert plugin_registry.resolve_connector_class(plain) is connectors.EchoConnector
    external = KVTransferConfig(
        kv_connector="ExternalConnector",
        kv_role="kv_both",
        kv_connector_module_path="kvx_test_plugin.connectors",
    )
    assert plugin_registry.resolve_connector_class(external) is connectors.ExternalConnector


def test_two_argument_constructor_is_refused(plugin_registry: Registry) -> None:
    config = KVTransferConfig(
        kv_connector="TwoArgConnector",
        kv_role="kv_both",
        kv_connector_module_path="kvx_test_plugin.connectors",
    )
    with pytest.raises(RegistryError, match=r"must accept \(config, role, ctx\); .*2-argument"):
        plugin_registry.resolve_connector_class(config)


def test_duplicate_entry_point_is_refused_and_recorded(plugin_registry: Registry) -> None:
    problems = {p.plugin: p.message for p in plugin_registry.problems}
    assert problems["kvx_test_plugin_duplicate"] == (
        "RegistryError: connector name 'EchoConnector' from plugin 'kvx_test_plugin_duplicate' "
        "(kvx-test-plugin 0.0.1) is already registered by plugin 'kvx_test_plugin' "
        "(kvx-test-plugin 0.0.1); set override=True in the spec to replace it deliberately"
    )
    assert plugin_registry.connector("EchoConnector").plugin == "kvx_test_plugin"


def test_broken_plugin_is_recorded_not_fatal(plugin_registry: Registry) -> None:
    problems = {p.plugin: p.message for p in plugin_registry.problems}
    assert problems["kvx_test_plugin_broken"] == ("RuntimeError: this plugin is broken on purpose")


def test_hand_registered_duplicate_fails_unless_override(plugin_registry: Registry) -> None:
    class Clash:
        @kvx.hookimpl
        def kvx_connectors(self) -> list[ConnectorSpec]:
            return [ConnectorSpec(name="Other", target="x:Y", aliases=("EchoConnector",))]

    with pytest.raises(RegistryError, match="connector name 'EchoConnector' from plugin 'clash'"):
        plugin_registry.register_plugin(Clash(), name="clash")
    assert "Other" not in plugin_registry.connectors()
    assert not plugin_registry.pm.has_plugin("clash")

    class Replacement:
        @kvx.hookimpl
        def kvx_connectors(self) -> list[ConnectorSpec]:
            return [
                ConnectorSpec(
                    name="EchoConnector",
                    override=True,
                    target="kvx_test_plugin.connectors:EchoHMAConnector",
                )
            ]

    plugin_registry.register_plugin(Replacement(), name="replacement")
    assert plugin_registry.connector("EchoConnector").plugin == "replacement"
    assert plugin_registry.connector("TestEcho").name == "EchoConnector"
    plugin_registry.unregister_plugin("replacement")
    assert plugin_registry.connector("EchoConnector").plugin == "kvx_test_plugin"


def test_hook_returning_wrong_type_is_refused(plugin_registry: Registry) -> None:
    class Wrong:
        @kvx.hookimpl
        def kvx_connectors(self) -> list[str]:
            return ["EchoConnector"]

    with pytest.raises(
        RegistryError,
        match=r"kvx_connectors\(\) returned 'EchoConnector'; "
        "expected ConnectorSpec",
    ):
        plugin_registry.register_plugin(Wrong(), name="wrong")


def test_contract_major_mismatch_names_fitting_releases(plugin_registry: Registry) -> None:
    with pytest.raises(RegistryError) as info:
        plugin_registry.load_connector_class("FutureContractConnector")
    assert str(info.value) == (
        "connector 'FutureContractConnector' (kvx_test_plugin.connectors:FutureContractConnector)"
        " implements kvx connector contract 2.0, but kvx 0.1.0 implements contract 1.0; use a "
        "kvx release implementing contract 2.x (none is known to kvx 0.1.0) for this connector, "
        "or port it to contract 1.x"
    )


def test_non_connector_class_is_refused(plugin_registry: Registry) -> None:
    with pytest.raises(RegistryError, match=r"is not a subclass of kvx\.KVConnectorBase_V1"):
        plugin_registry.load_connector_class("NotAConnector")


def test_block_list_and_autoload_switch(plugin_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # With the owner blocked, the would-be duplicate takes the name.
    taken = Registry(blocked=["kvx_test_plugin"]).connector("EchoConnector")
    assert taken.plugin == "kvx_test_plugin_duplicate"
    monkeypatch.setenv("KVX_BLOCKED_PLUGINS", "kvx_test_plugin, kvx_test_plugin_duplicate")
    blocked = Registry()
    assert "EchoConnector" not in blocked.connectors()
    assert "kvx_test_plugin_broken" in {p.plugin for p in blocked.problems}
    monkeypatch.delenv("KVX_BLOCKED_PLUGINS")
    monkeypatch.setenv("KVX_DISABLE_PLUGIN_AUTOLOAD", "1")
    empty = Registry()
    assert empty.connectors() == {} and empty.layouts() == {} and empty.problems == []


def test_create_connector_builds_each_role(plugin_registry: Registry) -> None:
    config = KVTransferConfig.from_dict(
        {"kv_connector": "TestEcho", "kv_role": "kv_both"}, registry=plugin_registry
    )
    for role in KVConnectorRole:
        connector = create_connector(config, role, CTX, registry=plugin_registry)
        assert type(connector).__name__ == "EchoConnector"
        assert connector.role is role
        assert connector.kv_transfer_config is config
        assert connector.engine_context == CTX  # the engine's context, carrying the registry
        assert connector.engine_context.registry is plugin_registry


def test_create_connector_validates_programmatic_configs(plugin_registry: Registry) -> None:
    config = KVTransferConfig(
        kv_connector="EchoConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"num_threads": 0},
    )
    with pytest.raises(kvx.ConfigError, match=r"kv_connector_extra_config\.num_threads"):
        create_connector(config, KVConnectorRole.WORKER, CTX, registry=plugin_registry)


def test_hma_requires_supports_hma(plugin_registry: Registry) -> None:
    hma_ctx = EngineContext(engine_id="e", model_name="m", cache=CTX.cache, enable_hma=True)
    plain = KVTransferConfig(kv_connector="EchoConnector", kv_role="kv_both")
    with pytest.raises(
        RegistryError,
        match=r"'EchoConnector' does not support HMA but HMA is "
        "enabled",
    ):
        create_connector(plain, KVConnectorRole.SCHEDULER, hma_ctx, registry=plugin_registry)
    hma = KVTransferConfig(kv_connector="EchoHMAConnector", kv_role="kv_both")
    assert create_connector(hma, KVConnectorRole.SCHEDULER, hma_ctx, registry=plugin_registry)

    def composite(*names: str) -> KVTransferConfig:
        return KVTransferConfig.from_dict(
            {
                "kv_connector": "CompositeConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"connectors": [{"kv_connector": n} for n in names]},
            },
            registry=plugin_registry,
        )

    assert plugin_registry.supports_hma_config(composite("EchoHMAConnector", "EchoHMAConnector"))
    assert not plugin_registry.supports_hma_config(composite("EchoHMAConnector", "TestEcho"))


def _refused(registry: Registry, plugin: object, name: str) -> str:
    """Register `plugin`, expect a refusal, check nothing of it stayed; the message."""
    before = registry.connectors()
    with pytest.raises(RegistryError) as info:
        registry.register_plugin(plugin, name=name)
    assert not registry.pm.has_plugin(name)
    assert registry.connectors() == before
    assert registry.pm.hook.kvx_connectors.get_hookimpls() == [
        impl for impl in registry.pm.hook.kvx_connectors.get_hookimpls() if impl.plugin_name != name
    ]
    return str(info.value)


def _spec() -> list[ConnectorSpec]:
    return [ConnectorSpec(name="Refused", target="x:Y")]


def test_hook_without_marker_is_refused(plugin_registry: Registry) -> None:
    class Unmarked:
        def kvx_connectors(self) -> list[ConnectorSpec]:
            return _spec()

    assert _refused(plugin_registry, Unmarked(), "unmarked") == (
        "plugin 'unmarked': kvx_connectors is not marked @kvx.hookimpl, so pluggy would never "
        "call it; mark it"
    )


def test_misspelt_hook_is_refused_marked_or_not(plugin_registry: Registry) -> None:
    class Marked:
        @kvx.hookimpl
        def kvx_conectors(self) -> list[ConnectorSpec]:
            return _spec()

    class Plain:
        def kvx_conectors(self) -> list[ConnectorSpec]:
            return _spec()

    hooks = (
        '"kvx_cli_commands", "kvx_connectors", "kvx_layouts", "kvx_storage_backends", '
        '"kvx_transforms"'
    )
    assert _refused(plugin_registry, Marked(), "marked-typo") == (
        "plugin 'marked-typo': kvx_conectors is marked @kvx.hookimpl but is not a kvx hook "
        f'(did you mean "kvx_connectors"?); hooks: {hooks}'
    )
    assert _refused(plugin_registry, Plain(), "plain-typo") == (
        "plugin 'plain-typo': kvx_conectors is not a kvx hook (did you mean \"kvx_connectors\"?); "
        f"hooks: {hooks} (names starting with kvx_ are reserved for hooks)"
    )


def test_hook_with_a_wrong_argument_is_refused(plugin_registry: Registry) -> None:
    class WrongArgument:
        @kvx.hookimpl
        def kvx_connectors(self, config: dict[str, str]) -> list[ConnectorSpec]:
            return _spec()

    message = _refused(plugin_registry, WrongArgument(), "wrong-argument")
    assert message.startswith("plugin 'wrong-argument': hookimpl definition: kvx_connectors(")
    assert "{'config'} are declared in the hookimpl but can not be found in the hookspec" in message
    assert message.endswith("(kvx hooks take no arguments)")


def test_refused_entry_point_plugin_is_recorded_with_the_reason(
    plugin_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A third-party plugin with a misspelt hook, found through its entry point."""
    dist = tmp_path / "kvx_typo_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kvx-typo-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[kvx]\ntypo = kvx_typo_plugin\n")
    (tmp_path / "kvx_typo_plugin.py").write_text(
        "import kvx\n\n@kvx.hookimpl\ndef kvx_layots():\n    return []\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    problems = {p.plugin: p.message for p in Registry().problems}
    assert problems["typo"].startswith(
        "RegistryError: plugin 'typo': kvx_layots is marked @kvx.hookimpl but is not a kvx hook "
        '(did you mean "kvx_layouts"?)'
    )


def test_hooks_are_called_through_pluggy(plugin_registry: Registry) -> None:
    """Every catalog entry comes from a pluggy hook call: the hook's results are its specs."""
    called = [spec.name for specs in plugin_registry.pm.hook.kvx_connectors() for spec in specs]
    assert sorted(called) == sorted(plugin_registry.connectors())


def test_get_layout_is_the_public_lookup(plugin_registry: Registry) -> None:
    layout = kvx.get_layout("NHD")
    assert isinstance(layout, kvx.KVLayout)
    assert (layout.name, layout.blocks_dim) == ("NHD", 1)
    with pytest.raises(RegistryError, match=r"'NHDD' is not a registered layout \(did you mean"):
        kvx.get_layout("NHDD")
    with pytest.raises(RegistryError, match="'TEST_LAYOUT' resolves to str, which is not a layout"):
        kvx.get_layout("TEST_LAYOUT")


def test_provides_builds_the_hook_a_plugin_module_names(plugin_registry: Registry) -> None:
    """`kvx_connectors = kvx.provides(...)` registers like the hand-written hook, and is checked
    alike: a misspelt name, or records of another kind, refuse the plugin."""
    plugin = types.ModuleType("tabled")
    plugin.kvx_connectors = kvx.provides(  # type: ignore[attr-defined]
        ConnectorSpec(name="Tabled", target="kvx_test_plugin.connectors:EchoConnector"),
        ConnectorSpec(name="Missing", target="x:Y", requires=("kvx_never_installed",), extra="e"),
    )
    plugin_registry.register_plugin(plugin, name="tabled")
    assert plugin_registry.connector("Tabled").plugin == "tabled"
    assert plugin_registry.load_connector_class("Tabled").__name__ == "EchoConnector"
    with pytest.raises(MissingDependencyError, match=r"needs 'kvx_never_installed'.*\[e\]"):
        plugin_registry.load_connector_class("Missing")  # lazy: only now is it looked for

    misspelt = types.ModuleType("misspelt")
    misspelt.kvx_conectors = kvx.provides(*_spec())  # type: ignore[attr-defined]
    assert "kvx_conectors is marked @kvx.hookimpl but is not a kvx hook" in _refused(
        plugin_registry, misspelt, "misspelt"
    )
    wrong_kind = types.ModuleType("wrong_kind")
    wrong_kind.kvx_connectors = kvx.provides(  # type: ignore[attr-defined]
        kvx.LayoutSpec(name="L", target="x:Y")
    )
    assert "expected ConnectorSpec" in _refused(plugin_registry, wrong_kind, "wrong_kind")
