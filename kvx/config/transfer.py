"""`KVTransferConfig`: the JSON an operator passes as `--kv-transfer-config`.

Field names, defaults and rules match vLLM's `KVTransferConfig` (0.33 fields plus the legacy ones,
which are accepted). Beyond vLLM, kvx validates strictly: unknown keys are errors (with a
did-you-mean), types are checked, and each connector's `kv_connector_extra_config` is validated
against the typed schema the connector declares, recursively for composite connectors such as
MultiConnector. Every error names the path, the bad value and what is allowed.
"""

from __future__ import annotations

import hashlib
import json
import math
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol, TypeVar

import msgspec

from kvx.config import schema
from kvx.config.yaml_files import YAML_SUFFIXES, parse_yaml
from kvx.errors import ConfigError, ConfigProblem, did_you_mean, quote, quoted_list

T = TypeVar("T")

KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]
KV_ROLES: tuple[str, ...] = ("kv_producer", "kv_consumer", "kv_both")
LoadFailurePolicy = Literal["recompute", "fail"]
LOAD_FAILURE_POLICIES: tuple[str, ...] = ("recompute", "fail")
LEGACY_FIELDS: tuple[str, ...] = ("kv_buffer_size", "kv_rank", "kv_parallel_size", "kv_ip")
MAX_CONFIG_BYTES = 1 << 20
MAX_JSON_DEPTH = 64
MAX_NESTING = 8
"""How deep composite connectors (a MultiConnector inside a MultiConnector...) may nest."""


@dataclass(frozen=True)
class ExtraConfigTarget:
    """How to validate one connector's `kv_connector_extra_config`."""

    name: str
    schema: Any
    child_configs_key: str | None = None
    unchecked: bool = False  # a module-path class that declares no schema


class ConfigResolver(Protocol):
    """What config validation needs from a registry (`kvx.Registry` is one): how to validate
    the extra config of a connector named `connector` (or loaded from `module_path`); raises
    `ConfigError` for an unknown one. `config_path` locates the config (nested children)."""

    def extra_config_target(
        self, connector: str, module_path: str | None, config_path: str = ""
    ) -> ExtraConfigTarget: ...


_default_resolver: Callable[[], ConfigResolver] | None = None


def set_default_resolver(get: Callable[[], ConfigResolver] | None) -> None:
    """Install how `KVTransferConfig.from_dict` finds a resolver when given none.

    `kvx.registry.core` installs the process-wide registry's getter when it is imported, so this
    module never imports the registry (no config <-> registry circle); code below the entry
    points passes its registry explicitly."""
    global _default_resolver
    _default_resolver = get


@dataclass
class KVTransferConfig:
    """Configuration of KV cache transfer for one engine (vLLM's `KVTransferConfig`).

    `engine_id` is replaced by a fresh UUID when not given, so two engines never share one by
    accident. `kv_buffer_device` defaults to `"cpu"` (vLLM defaults to the platform's device);
    set `"cuda"` on GPU engines. The legacy fields `kv_buffer_size`, `kv_rank`,
    `kv_parallel_size` and `kv_ip` are accepted for old JSON; only P2P NCCL reads any of them.
    """

    kv_connector: str | None = None
    engine_id: str | None = None
    kv_buffer_device: str = "cpu"
    kv_role: KVRole | None = None
    kv_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 14579
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    kv_connector_module_path: str | None = None
    enable_permute_local_kv: bool = False
    kv_load_failure_policy: LoadFailurePolicy = "fail"
    kv_buffer_size: Annotated[float, msgspec.Meta(ge=0)] = 1e9
    kv_rank: int | None = None
    kv_parallel_size: Annotated[int, msgspec.Meta(ge=1)] = 1
    kv_ip: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if self.engine_id is None:
            self.engine_id = str(uuid.uuid4())
        problems = _rule_problems(asdict(self), path="")
        if self.kv_load_failure_policy not in LOAD_FAILURE_POLICIES:
            problems.append(
                ConfigProblem(
                    "kv_load_failure_policy",
                    _not_allowed(self.kv_load_failure_policy, LOAD_FAILURE_POLICIES),
                )
            )
        if problems:
            raise ConfigError(problems)

    # -- vLLM's helpers -------------------------------------------------------------------

    @property
    def is_kv_transfer_instance(self) -> bool:
        return self.kv_connector is not None and self.kv_role in KV_ROLES

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_connector is not None and self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_connector is not None and self.kv_role in ("kv_consumer", "kv_both")

    def get_from_extra_config(self, key: str, default: Any) -> Any:
        return self.kv_connector_extra_config.get(key, default)

    def has_connector(self, name: str) -> bool:
        """True if this config uses connector `name`, directly or as a MultiConnector child."""
        if self.kv_connector == name:
            return True
        children = self.kv_connector_extra_config.get("connectors")
        return (
            self.kv_connector == "MultiConnector"
            and isinstance(children, list)
            and any(isinstance(c, Mapping) and c.get("kv_connector") == name for c in children)
        )

    def compute_hash(self) -> str:
        """The transfer config never affects the compiled graph (matches vLLM)."""
        return hashlib.sha256(str([]).encode()).hexdigest()

    # -- conversions -----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    def extra_config_as(self, schema_type: type[T]) -> T:
        """The extra config as the connector's typed schema object (defaults filled in)."""
        return schema.convert(
            self.kv_connector_extra_config, schema_type, "kv_connector_extra_config"
        )

    @classmethod
    def from_dict(
        cls, data: Any, *, registry: ConfigResolver | None = None, check_extra: bool = True
    ) -> KVTransferConfig:
        """Validate a JSON-like dict and build the config; raise `ConfigError` listing every
        problem. With `check_extra` (default) the connector name is resolved in `registry` (any
        `ConfigResolver`; default: the one `set_default_resolver` installed, the process-wide
        registry) and its extra config validated against the connector's schema (children of
        composites too)."""
        if check_extra and registry is None and _default_resolver is not None:
            registry = _default_resolver()
        problem = _depth_problem(data)
        if problem is not None:  # checked first: every later step may recurse
            raise problem
        normalised = _validate(data, "", registry if check_extra else None, parent=None)
        return cls(**normalised)

    @classmethod
    def from_json(cls, text: str, **kwargs: Any) -> KVTransferConfig:
        """Parse a JSON object string (see `from_dict` for the keyword arguments)."""
        return cls.from_dict(parse_json(text), **kwargs)

    @classmethod
    def from_cli(cls, arg: str, **kwargs: Any) -> KVTransferConfig:
        """Parse a `--kv-transfer-config` value: a JSON object, or `@path/to/file.json` (or
        `.yaml`/`.yml`)."""
        return cls.from_dict(load_cli_arg(arg), **kwargs)


CONFIG_KEYS: tuple[str, ...] = tuple(f.name for f in fields(KVTransferConfig))


def load_cli_arg(arg: str) -> Any:
    """The JSON value of a `--kv-transfer-config` argument: `'{...}'`, `'@file.json'`, or
    `'@file.yaml'` (`.yaml`/`.yml`: YAML holding the same keys and values)."""
    if arg.startswith("@"):
        path = Path(arg[1:])
        try:
            size = path.stat().st_size
            if size > MAX_CONFIG_BYTES:
                raise ConfigError(
                    [
                        ConfigProblem(
                            "",
                            f"config file {str(path)!r} is {size} bytes; "
                            f"at most {MAX_CONFIG_BYTES} allowed",
                        )
                    ]
                )
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(
                [
                    ConfigProblem(
                        "",
                        f"cannot read config file {str(path)!r}: {exc.__class__.__name__}: {exc}",
                    )
                ]
            ) from None
        if path.suffix.lower() in YAML_SUFFIXES:
            return parse_yaml(text, str(path), MAX_JSON_DEPTH)
        return parse_json(text)
    return parse_json(arg)


def parse_json(text: str) -> Any:
    """Parse JSON text, refusing NaN/Infinity and oversized input with a ConfigError."""
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(
            [
                ConfigProblem(
                    "", f"config is {len(text)} characters; at most {MAX_CONFIG_BYTES} allowed"
                )
            ]
        )

    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")

    try:
        value = json.loads(text, parse_constant=no_constants)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            [
                ConfigProblem(
                    "", f"not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
                )
            ]
        ) from None
    except (ValueError, RecursionError) as exc:
        raise ConfigError([ConfigProblem("", f"not valid JSON: {exc}")]) from None
    problem = _depth_problem(value)
    if problem is not None:
        raise problem
    return value


def too_deep(value: Any, limit: int = MAX_JSON_DEPTH, path: str = "") -> str | None:
    """The path of the first object or array nested deeper than `limit` levels in `value`
    (None if none). Iterative and stopping at the limit: a value nested 100,000 deep, or one
    that contains itself, costs at most `limit` levels of work per branch."""
    todo: list[tuple[Any, int, str]] = [(value, 1, path)]
    while todo:
        item, level, where = todo.pop()
        if not isinstance(item, dict | list):
            continue
        if level > limit:
            return where
        pairs = item.items() if isinstance(item, dict) else enumerate(item)
        todo.extend((child, level + 1, schema.join_path(where, key)) for key, child in pairs)
    return None


def _depth_problem(value: Any) -> ConfigError | None:
    where = too_deep(value)
    if where is None:
        return None
    if len(where) > 120:
        where = where[:117] + "..."
    return ConfigError(
        [ConfigProblem(where, f"nested deeper than {MAX_JSON_DEPTH} levels of objects and arrays")]
    )


def _not_allowed(value: Any, allowed: tuple[str, ...]) -> str:
    hint = did_you_mean(value, allowed) if isinstance(value, str) else ""
    return f"{schema.show(value)} is not allowed; allowed: {quoted_list(allowed)}{hint}"


def _rule_problems(data: Mapping[str, Any], path: str) -> list[ConfigProblem]:
    """vLLM's `__post_init__` rules that are not plain type checks."""
    problems = []
    connector, role = data.get("kv_connector"), data.get("kv_role")
    if role is not None and role not in KV_ROLES:
        problems.append(
            ConfigProblem(schema.join_path(path, "kv_role"), _not_allowed(role, KV_ROLES))
        )
    if connector is not None and role is None:
        problems.append(
            ConfigProblem(
                schema.join_path(path, "kv_role"),
                f"required when kv_connector is set ({quote(connector)}); "
                f"allowed: {quoted_list(KV_ROLES)}",
            )
        )
    if data.get("kv_connector_module_path") == "":
        problems.append(
            ConfigProblem(
                schema.join_path(path, "kv_connector_module_path"),
                '"" (string) is not allowed; give an importable module path or leave it out',
            )
        )
    if connector == "":
        problems.append(
            ConfigProblem(
                schema.join_path(path, "kv_connector"),
                '"" (string) is not allowed; give a connector name',
            )
        )
    buffer_size = data.get("kv_buffer_size")
    if isinstance(buffer_size, float) and not math.isfinite(buffer_size):
        problems.append(
            ConfigProblem(
                schema.join_path(path, "kv_buffer_size"), f"{buffer_size!r} is not a finite number"
            )
        )
    return problems


def _validate(
    data: Any,
    path: str,
    registry: ConfigResolver | None,
    parent: Mapping[str, Any] | None,
    depth: int = 0,
) -> dict[str, Any]:
    """Check one config dict (and its children); return it normalised or raise ConfigError."""
    if not isinstance(data, dict):
        raise ConfigError([ConfigProblem(path, f"expected a JSON object, got {schema.show(data)}")])
    if depth > MAX_NESTING:
        raise ConfigError(
            [
                ConfigProblem(
                    path,
                    f"connectors nest {depth} deep here; at most {MAX_NESTING} levels allowed",
                )
            ]
        )
    data = dict(data)
    if parent is not None:  # MultiConnector children inherit engine id and role (vLLM semantics)
        data.setdefault("engine_id", parent.get("engine_id"))
        data.setdefault("kv_role", parent.get("kv_role"))
    if data.get("engine_id") is None:
        data["engine_id"] = str(uuid.uuid4())
    problems = schema.check(data, KVTransferConfig, path)
    bad_paths = {p.path for p in problems}
    problems += [p for p in _rule_problems(data, path) if p.path not in bad_paths]
    connector = data.get("kv_connector")
    if (
        registry is not None
        and isinstance(connector, str)
        and connector
        and not any(p.path.startswith(schema.join_path(path, "kv_connector")) for p in problems)
    ):
        extra = data.get("kv_connector_extra_config", {})
        try:
            data["kv_connector_extra_config"] = _validate_extra(data, extra, path, registry, depth)
        except ConfigError as exc:
            problems += exc.problems
    elif (
        parent is not None
        and not connector
        and not data.get("kv_connector_module_path")
        and schema.join_path(path, "kv_connector") not in bad_paths
    ):
        problems.append(
            ConfigProblem(
                schema.join_path(path, "kv_connector"),
                "a child connector needs kv_connector (its connector's name) or "
                "kv_connector_module_path; it has neither",
            )
        )
    elif connector is None and data.get("kv_connector_extra_config"):
        problems.append(
            ConfigProblem(
                schema.join_path(path, "kv_connector_extra_config"),
                "given, but kv_connector is not set: there is no connector to configure; "
                "set kv_connector or leave kv_connector_extra_config out",
            )
        )
    if problems:
        raise ConfigError(problems)
    return data


def _registry_problems(
    typed: Any, registry: ConfigResolver, extra_path: str
) -> list[ConfigProblem]:
    """A schema's checks that need the registry it is validated against: its optional
    `registry_checks(registry) -> list[ConfigProblem]` (paths relative to the extra config),
    e.g. that a storage URL's scheme has a backend in that registry."""
    check = getattr(typed, "registry_checks", None)
    if not callable(check):
        return []
    return [
        ConfigProblem(schema.join_path(extra_path, p.path) if p.path else extra_path, p.message)
        for p in check(registry)
    ]


def _validate_extra(
    data: dict[str, Any], extra: Any, path: str, registry: ConfigResolver, depth: int
) -> dict[str, Any]:
    """Validate `kv_connector_extra_config` against the connector's declared schema."""
    extra_path = schema.join_path(path, "kv_connector_extra_config")
    if not isinstance(extra, dict):
        return extra  # the type problem is already reported by schema.check
    target = registry.extra_config_target(
        data["kv_connector"], data.get("kv_connector_module_path"), config_path=path
    )
    problems: list[ConfigProblem] = []
    normalised: dict[str, Any] = {}
    rest = dict(extra)
    if target.child_configs_key is not None:
        key = target.child_configs_key
        children = rest.pop(key, None)
        child_path = schema.join_path(extra_path, key)
        if not isinstance(children, list) or not children:
            problems.append(
                ConfigProblem(
                    child_path,
                    f"expected a non-empty list of connector configs, got {schema.show(children)}",
                )
            )
        else:
            normalised[key] = []
            for i, child in enumerate(children):
                try:
                    normalised[key].append(
                        _validate(child, schema.join_path(child_path, i), registry, data, depth + 1)
                    )
                except ConfigError as exc:
                    problems += exc.problems
    if target.schema is None:
        if target.unchecked:
            normalised.update(rest)
        else:
            problems += [
                ConfigProblem(
                    schema.join_path(extra_path, k),
                    f"unknown key; {target.name} takes no extra config keys",
                )
                for k in rest
            ]
    else:
        try:
            typed = schema.convert(rest, target.schema, extra_path)
            normalised.update(msgspec.to_builtins(typed))
        except ConfigError as exc:
            problems += exc.problems
        else:
            problems += _registry_problems(typed, registry, extra_path)
    if problems:
        raise ConfigError(problems)
    return normalised
