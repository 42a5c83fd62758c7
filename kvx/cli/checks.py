"""What `kvx validate` adds to a valid config: notes, redaction of inline secrets, and the
`--check` pass that tries the config on this machine.

Every connector of a config (a composite's children too) is visited with its typed extra
config. A connector's schema may define two optional methods, which kvx calls here:

- `config_notes(self) -> list[ConfigProblem]`: what the operator should know (a vLLM spelling
  mapped, where a value came from); paths relative to `kv_connector_extra_config`.
- `config_checks(self) -> list[ConfigProblem]`: try what the config names (open the store,
  bind the ports) and report what fails, paths as above. Run by `kvx validate --check` only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from kvx.config import schema
from kvx.config.secrets import inline_secrets, redact_secrets, resolve_secret, secret_fields
from kvx.config.transfer import KVTransferConfig
from kvx.errors import ConfigError, ConfigProblem, MissingDependencyError, RegistryError
from kvx.registry.core import Registry


@dataclass(frozen=True)
class ConnectorConfig:
    """One connector of a config: where it is (`path`, "" for the top), its config dict and
    its typed extra config (None when its connector declares no schema)."""

    path: str
    data: dict[str, Any]
    schema: Any
    typed: Any


def connector_configs(config: KVTransferConfig, registry: Registry) -> Iterator[ConnectorConfig]:
    """The config's connectors, the top one first, then each composite's children."""
    todo: list[tuple[str, dict[str, Any]]] = [("", config.to_dict())]
    while todo:
        path, data = todo.pop(0)
        name = data.get("kv_connector")
        if not name:
            continue
        target = registry.extra_config_target(
            name, data.get("kv_connector_module_path"), config_path=path
        )
        extra = dict(data.get("kv_connector_extra_config") or {})
        children_key = target.child_configs_key
        children = extra.pop(children_key, []) if children_key else []
        typed = None
        if target.schema is not None:
            typed = schema.convert(extra, target.schema, _extra_path(path))
        yield ConnectorConfig(path, data, target.schema, typed)
        child_path = _extra_path(path) + f".{children_key}"
        todo += [(f"{child_path}[{i}]", child) for i, child in enumerate(children)]


def _extra_path(path: str) -> str:
    return schema.join_path(path, "kv_connector_extra_config")


def _relative(item: ConnectorConfig, problems: list[ConfigProblem]) -> list[ConfigProblem]:
    base = _extra_path(item.path)
    return [
        ConfigProblem(schema.join_path(base, p.path) if p.path else base, p.message)
        for p in problems
    ]


def _hook(item: ConnectorConfig, name: str) -> list[ConfigProblem]:
    method: Callable[[], list[ConfigProblem]] | None = getattr(item.typed, name, None)
    return _relative(item, list(method())) if callable(method) else []


def config_notes(items: list[ConnectorConfig]) -> list[str]:
    """Notes of every connector's schema (`config_notes`) and a warning for each secret given
    inline, which `ps` shows when the config is passed on a command line."""
    notes = []
    for item in items:
        notes += [str(p) for p in _hook(item, "config_notes")]
        extra = item.data.get("kv_connector_extra_config") or {}
        for key in inline_secrets(extra, item.schema):
            notes.append(
                f"{_extra_path(item.path)}.{key} is given inline: anyone who can list this "
                'machine\'s processes sees it on a command line; give {"env": "NAME"} or '
                '{"file": "/path"} instead'
            )
    return notes


def import_notes(
    items: list[ConnectorConfig], registry: Registry, *, imports: bool = True
) -> list[str]:
    """Whether each connector can be used here: a note when an optional dependency is missing
    (the config may run elsewhere), `RegistryError` when its class cannot be used at all.
    `imports=False`: judge each class from its source, without importing it (and torch)."""
    notes = []
    for item in items:
        where = f"{item.path}: " if item.path else ""
        name, module_path = item.data["kv_connector"], item.data.get("kv_connector_module_path")
        if module_path:
            if item.schema is None and item.data.get("kv_connector_extra_config"):
                notes.append(
                    f"{where}{name} declares no extra_config_schema; its "
                    "kv_connector_extra_config was not validated"
                )
            continue
        entry = registry.connector(name)
        hint = entry.install_hint()
        if hint:
            missing = ", ".join(entry.missing())
            notes.append(f"{where}connector {entry.name!r} needs {missing} to run: {hint}")
            continue
        try:
            if imports:
                registry.load_connector_class(entry.name)
            else:
                registry.check_connector_class(entry.name)
        except MissingDependencyError as exc:
            notes.append(f"{where}{exc} to run")
        except RegistryError as exc:
            which = f"the connector at {item.path}" if item.path else "its connector"
            raise RegistryError(f"the config is valid but {which} cannot be used: {exc}") from None
    return notes


def redacted(config: KVTransferConfig, items: list[ConnectorConfig]) -> dict[str, Any]:
    """The config as a dict with every inline secret shown as `"***"`."""
    shown = config.to_dict()
    for item in items:
        if not secret_fields(item.schema):
            continue
        holder = _at(shown, item.path)
        holder["kv_connector_extra_config"] = redact_secrets(
            holder.get("kv_connector_extra_config") or {}, item.schema
        )
    return shown


def _at(data: dict[str, Any], path: str) -> dict[str, Any]:
    """The connector config at `path` (`kv_connector_extra_config.connectors[1]...`)."""
    node: Any = data
    for part in path.split(".") if path else []:
        name, _, index = part.partition("[")
        node = node[name]
        if index:
            node = node[int(index.rstrip("]"))]
    result: dict[str, Any] = node
    return result


def check_config(items: list[ConnectorConfig], registry: Registry) -> list[ConfigProblem]:
    """Try the config on this machine (`kvx validate --check`): each connector's class imports,
    each secret can be read, and each schema's `config_checks` passes (the store opens, the
    ports bind). Every failure is a `ConfigProblem` naming the key."""
    problems: list[ConfigProblem] = []
    for item in items:
        name = item.data["kv_connector"]
        module_path = item.data.get("kv_connector_module_path")
        try:
            if module_path:
                one = KVTransferConfig.from_dict(item.data, check_extra=False)
                registry.resolve_connector_class(one)
            else:
                registry.load_connector_class(name)
        except RegistryError as exc:
            where = "kv_connector_module_path" if module_path else "kv_connector"
            problems.append(
                ConfigProblem(schema.join_path(item.path, where), f"cannot be used: {exc}")
            )
            continue
        extra = item.data.get("kv_connector_extra_config") or {}
        for key in secret_fields(item.schema):
            try:
                resolve_secret(extra.get(key), f"{_extra_path(item.path)}.{key}")
            except ConfigError as exc:
                problems += exc.problems
        try:
            problems += _hook(item, "config_checks")
        except ConfigError as exc:
            problems += exc.problems
        except Exception as exc:  # a schema's check that did not expect this failure
            problems.append(
                ConfigProblem(_extra_path(item.path), f"check failed: {type(exc).__name__}: {exc}")
            )
    return list(dict.fromkeys(problems))  # a schema's own check may repeat the secret's


def check_report(items: list[ConnectorConfig]) -> list[str]:
    """What a passing `check_config` tried, one line per connector, and what it could not: a
    connector whose schema has no `config_checks` says so (nothing its config names was
    opened or bound). A hook's docstring, after a leading "`kvx validate --check`:", says what
    it tries."""
    if not items:
        return ["check: no connector is set: nothing to try"]
    lines = []
    for item in items:
        where = f"{item.path}: " if item.path else ""
        done = [f"{item.data['kv_connector']} imports"]
        extra = item.data.get("kv_connector_extra_config") or {}
        secrets = [key for key in secret_fields(item.schema) if extra.get(key) is not None]
        if secrets:
            done.append(f"{'secrets' if len(secrets) > 1 else 'secret'} {', '.join(secrets)} read")
        hook = getattr(item.typed, "config_checks", None)
        if callable(hook):
            what = _hook_summary(hook)
            done.append(f"its config_checks passed{': ' + what if what else ''}")
            lines.append(f"check: {where}" + "; ".join(done))
        elif any(o.path.startswith(_extra_path(item.path) + ".") for o in items):
            lines.append(f"check: {where}" + "; ".join(done) + "; its connectors:")
        else:
            lines.append(
                f"check: {where}" + "; ".join(done) + "; NOT checked: it defines no config_checks, "
                "so nothing its config names (paths, stores, addresses, ports) was tried"
            )
    return lines


def _hook_summary(hook: Callable[[], object]) -> str:
    """The first paragraph of a `config_checks` docstring, without its "`kvx validate
    --check`:" prefix, as one line."""
    doc = " ".join((hook.__doc__ or "").split("\n\n", 1)[0].split())
    return doc.removeprefix("`kvx validate --check`:").strip().rstrip(".")
