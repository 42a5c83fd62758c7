"""What plugins register: small frozen records returned by the `kvx_*` hooks.

A record names its implementation by a lazy `"module:attribute"` target, so listing plugins never
imports a connector's heavy dependencies; the import happens on first use.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, Self, runtime_checkable

from kvx.errors import RegistryError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Spec:
    """What every record has: the `name` it is registered under, its lazy `"module:attribute"`
    `target`, a one-line `summary`, other names (`aliases`) and `override` (replace an earlier
    registration of the same name instead of failing)."""

    name: str
    target: str
    summary: str = ""
    aliases: tuple[str, ...] = ()
    override: bool = False


@dataclass(frozen=True)
class ConnectorSpec(Spec):
    """A connector a plugin provides.

    - `target`: `"package.module:ClassName"` of the `KVConnectorBase_V1` subclass.
    - `config_schema`: `"package.module:Type"` of a msgspec Struct or dataclass describing the
      connector's `kv_connector_extra_config`; kvx validates the extra config against it before the
      connector is built. Keep it in a module without heavy imports. None = the connector accepts
      no extra keys.
    - `child_configs_key`: an extra-config key whose value is a list of whole `KVTransferConfig`
      dicts (MultiConnector's `connectors`); each is validated recursively.
    - `requires`: top-level modules the connector needs beyond kvx's own dependencies;
      `extra`: the kvx extra that installs them (named in the error when they are missing).
    - `imports_lazily`: the connector's module imports `requires` only when a connector is
      built, so vLLM's class lookup may import it (to learn whether it supports HMA).
    """

    config_schema: str | None = None
    child_configs_key: str | None = None
    requires: tuple[str, ...] = ()
    extra: str | None = None
    imports_lazily: bool = False

    @classmethod
    def in_package(
        cls,
        package: str | None,
        name: str,
        config: str | None = None,
        *,
        aliases: str | tuple[str, ...] = (),
        needs: str | None = None,
        **fields: Any,
    ) -> Self:
        """The record of a connector folder laid out as kvx's are: class `name` in
        `<package>.connector`, its extra-config type `config` (None: no extra keys) in
        `<package>.config`. `package` is the registering module's `__package__`.

        - `summary` defaults to the package docstring's first paragraph (a leading `"<name>: "`
          and the closing period dropped); the package is already imported when its `_plugin`
          module runs, and nothing else is read.
        - `aliases`: one other name, or a tuple of them.
        - `needs`: one module that is also the kvx extra installing it (`requires=(needs,)`,
          `extra=needs`).

        `fields` are the record's other fields (`requires`, `extra`, ...). Nothing is imported:
        the targets are still resolved on first use."""
        if package is None or not _is_dotted_name(package):
            raise _bad_field("package", package, "a dotted package name such as __package__")
        for field, value in (("name", name), ("config", config)):
            if value is not None and not value.isidentifier():
                raise _bad_field(field, value, "a class name, without the module")
        if needs is not None and not needs.isidentifier():
            raise _bad_field("needs", needs, "a top-level module name")
        if needs is not None:
            if "requires" in fields or "extra" in fields:
                raise _bad_field("needs", needs, "given together with requires= or extra=")
            fields.update(requires=(needs,), extra=needs)
        fields.setdefault("summary", _package_summary(package, name))
        schema = None if config is None else f"{package}.config:{config}"
        return cls(
            name,
            f"{package}.connector:{name}",
            aliases=(aliases,) if isinstance(aliases, str) else aliases,
            config_schema=schema,
            **fields,
        )


def _package_summary(package: str, name: str) -> str:
    """The first paragraph of an imported package's docstring, as a one-line summary."""
    module = sys.modules.get(package)
    doc = inspect.getdoc(module) if module is not None else None
    if not doc:
        return ""
    summary = " ".join(doc.split("\n\n", 1)[0].split())
    return summary.removeprefix(f"{name}: ").removesuffix(".")


def _is_dotted_name(text: str) -> bool:
    return all(part.isidentifier() for part in text.split("."))


def _bad_field(field: str, value: object, allowed: str) -> RegistryError:
    return RegistryError(f"ConnectorSpec.in_package: {field}={value!r} is not {allowed}")


@dataclass(frozen=True)
class LayoutSpec(Spec):
    """A KV cache layout: `target` resolves to the layout descriptor object."""


@dataclass(frozen=True)
class TransformSpec(Spec):
    """A block transform (layout or block-size conversion): `target` resolves to a callable."""


@dataclass(frozen=True)
class StorageBackendSpec(Spec):
    """A storage backend chosen by URL scheme (`file`, `memory`, `redis`, ...).

    - `target`: `"package.module:ClassName"` of a `kvx.StorageBackend` subclass.
    - `schemes`: the URL schemes it serves.
    - `other_schemes`: `"package.module:function"` of a predicate asked, lazily, about a
      scheme no backend lists (True: this backend serves it too), e.g. a protocol registry
      of the library behind the backend.
    """

    schemes: tuple[str, ...] = ()
    other_schemes: str | None = None
    requires: tuple[str, ...] = ()
    extra: str | None = None


@dataclass(frozen=True)
class CommandSpec(Spec):
    """A `kvx` subcommand a plugin provides (`kvx conformance` is one).

    `target` is `"package.module:function"` of `run(prog: str, argv: list[str]) -> int`: it parses
    `argv` (the words after the command's name) itself and returns the exit code. It is imported
    only when the command runs, so `kvx --help` and the other commands stay cheap. Raising
    `kvx.ConfigError` or `kvx.RegistryError` exits 2 with the message, as kvx's own commands do.
    """


@runtime_checkable
class KVLayout(Protocol):
    """What every layout a `LayoutSpec` names offers (`kvx.layouts.Layout` is the built-in one):
    its dims in tensor order (`shape`) and in memory order, and reading a tensor's sizes."""

    @property
    def name(self) -> str: ...

    @property
    def shape(self) -> tuple[str, ...]: ...

    @property
    def memory(self) -> tuple[str, ...]: ...

    @property
    def blocks_dim(self) -> int:
        """Index of the `blocks` dim in `shape`."""
        ...

    def sizes_of(self, tensor: torch.Tensor) -> dict[str, int]:
        """Each dim's size in `tensor`; ValueError if the tensor does not fit the layout."""
        ...
