"""`ConnectorSpec.in_package`: a connector folder's record from its package and class names."""

from __future__ import annotations

import pytest

from kvx import ConnectorSpec, RegistryError, get_registry
from kvx.registry.loading import load_target

# Each built-in's targets as its record spelled them before it used `in_package`.
WRITTEN_OUT = {
    "LMCacheConnectorV1": (
        "kvx.plugins.lmcache.connector:LMCacheConnectorV1",
        "kvx.plugins.lmcache.config:LMCacheConfig",
    ),
    "MultiConnector": (
        "kvx.plugins.multi:MultiConnector",
        "kvx.plugins.multi.config:MultiConnectorConfig",
    ),
    "NixlConnector": (
        "kvx.plugins.nixl.connector:NixlConnector",
        "kvx.plugins.nixl.config:NixlConfig",
    ),
    "OffloadingConnector": (
        "kvx.plugins.offload:OffloadingConnector",
        "kvx.plugins.offload.config:OffloadingConfig",
    ),
    "P2pNcclConnector": (
        "kvx.plugins.p2p.connector:P2pNcclConnector",
        "kvx.plugins.p2p.config:P2pConfig",
    ),
    "SharedStorageConnector": (
        "kvx.plugins.storage.connector:SharedStorageConnector",
        "kvx.plugins.storage.config:SharedStorageConfig",
    ),
}


def test_builds_the_conventional_targets_without_importing() -> None:
    spec = ConnectorSpec.in_package(
        "kvx_never_installed.pkg", "MyConnector", config="MyConfig", summary="s", extra="e"
    )
    assert spec.name == "MyConnector" and spec.summary == "s" and spec.extra == "e"
    assert spec.target == "kvx_never_installed.pkg.connector:MyConnector"
    assert spec.config_schema == "kvx_never_installed.pkg.config:MyConfig"
    assert ConnectorSpec.in_package("p", "C").config_schema is None  # no extra keys


@pytest.mark.parametrize("name", sorted(WRITTEN_OUT))
def test_builtin_records_resolve_to_the_same_classes(name: str) -> None:
    spec = get_registry().connector(name).spec
    target, schema = WRITTEN_OUT[name]
    assert spec.config_schema is not None
    assert load_target(spec.config_schema, what=name) is load_target(schema, what=name)
    if spec.target != target:  # the same string needs no import (LMCache is not in this venv)
        assert load_target(spec.target, what=name) is load_target(target, what=name)


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ((None, "C"), "package=None"),  # __package__ of a module run as a script
        (("", "C"), "package=''"),
        (("pkg.connector:C", "C"), "package='pkg.connector:C'"),
        (("pkg", "pkg.connector:C"), "name='pkg.connector:C'"),
    ],
)
def test_a_wrong_part_names_the_field(args: tuple[str | None, str], field: str) -> None:
    with pytest.raises(RegistryError, match=f"ConnectorSpec.in_package: {field} is not"):
        ConnectorSpec.in_package(*args)


def test_a_config_with_its_module_names_the_field() -> None:
    with pytest.raises(RegistryError, match=r"config='pkg.config:Cfg' is not a class name"):
        ConnectorSpec.in_package("pkg", "C", config="pkg.config:Cfg")


def test_needs_is_the_module_and_the_extra_that_installs_it() -> None:
    spec = ConnectorSpec.in_package("p", "C", needs="mylib", summary="s")
    assert spec.requires == ("mylib",) and spec.extra == "mylib"
    with pytest.raises(RegistryError, match=r"needs='mylib' is not given together with requires="):
        ConnectorSpec.in_package("p", "C", needs="mylib", extra="other")
    with pytest.raises(RegistryError, match=r"needs='my-lib' is not a top-level module name"):
        ConnectorSpec.in_package("p", "C", needs="my-lib")


def test_one_alias_may_be_given_as_a_string() -> None:
    assert ConnectorSpec.in_package("p", "C", aliases="C1").aliases == ("C1",)
    assert ConnectorSpec.in_package("p", "C", aliases=("C1", "C2")).aliases == ("C1", "C2")


def test_the_summary_defaults_to_the_package_docstring() -> None:
    import kvx.plugins.nixl

    doc_first_line = (kvx.plugins.nixl.__doc__ or "").splitlines()[0]
    assert doc_first_line == (
        "NixlConnector: prefill/decode hand-off: D reads P's KV blocks with NIXL (UCX) READs."
    )
    spec = get_registry().connector("NixlConnector").spec
    assert spec.summary == "prefill/decode hand-off: D reads P's KV blocks with NIXL (UCX) READs"
    assert ConnectorSpec.in_package("kvx.plugins.nixl", "X", summary="mine").summary == "mine"
    # A package that is not imported is not imported for its docstring.
    assert ConnectorSpec.in_package("kvx_never_installed.pkg", "C").summary == ""


def test_a_two_line_first_paragraph_becomes_one_line() -> None:
    summary = get_registry().connector("P2pNcclConnector").spec.summary
    assert summary.startswith("prefill/decode hand-off: P pushes") and "\n" not in summary
    assert "KV between workers" in summary and not summary.endswith(".")


def test_provides_connector_is_the_whole_hook() -> None:
    import kvx

    hook = kvx.provides_connector("pkg", "C", "Cfg", aliases="C1", needs="lib", summary="s")
    (spec,) = hook()
    assert spec == ConnectorSpec.in_package(
        "pkg", "C", "Cfg", aliases="C1", needs="lib", summary="s"
    )
    assert getattr(hook, "kvx_impl", None) is not None  # marked with @kvx.hookimpl
