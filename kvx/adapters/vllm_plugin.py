"""vLLM general plugin (entry point group `vllm.general_plugins`), loaded by vLLM in each of its
processes (API server or `LLM`, engine core, workers). It

- registers every kvx connector in vLLM's connector factory as `kvx.<name>`, so a config needs
  no module path:

      {"kv_connector": "kvx.SharedStorageConnector", "kv_role": "kv_both",
       "kv_connector_extra_config": {"storage_url": "file:///tmp/kv"}}

  (the `kvx.` prefix keeps kvx's names apart from vLLM's own `ExampleConnector`,
  `MultiConnector`, `NixlConnector`, ...);
- wraps the factory's class lookup (`get_connector_class`, `get_connector_class_by_name`):
  a kvx connector class that `kv_connector_module_path` names (an author's own module, packaged
  or not) is hosted in `kvx.adapters.vllm` instead of being refused for its constructor; the
  config of any kvx connector is validated when vLLM first resolves it (while vLLM builds its
  config, before an engine starts); and when the lookup fails, the error says what was asked for,
  what exists, the closest name and the install or PYTHONPATH fix (`vllm_lookup`). A class that
  is not kvx's gets vLLM's own lookup and checks, with only the failure messages improved.

Nothing of the adapter is imported until a config names a kvx connector.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

from kvx.adapters import VLLM_PREFIX as PREFIX

logger = logging.getLogger(__name__)

ADAPTER_MODULE = "kvx.adapters.vllm"


class KvxConnectorError(RuntimeError):
    """vLLM's KV transfer config asks for a kvx connector kvx cannot give it; the message says
    what to change. Not a `ValueError`: vLLM validates its config inside pydantic, which would
    print its own summary line below a `ValueError`'s message."""


def register() -> None:
    """Called by vLLM in each of its processes; a failure is logged, never raised into vLLM."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        from kvx.adapters.vllm_config import known_connectors
        from kvx.registry.core import get_registry

        for name in known_connectors(get_registry()):
            try:
                KVConnectorFactory.register_connector(PREFIX + name, ADAPTER_MODULE, name)
            except ValueError:  # already registered in this process
                continue
        hook_factory(KVConnectorFactory)
    except Exception:
        logger.exception("kvx could not register its connectors with vLLM")


def hook_factory(factory: Any) -> None:
    """Wrap `factory`'s class lookups (once per process)."""
    if getattr(factory, "_kvx_hooked", False):
        return
    by_config: Callable[[Any], type] = factory.get_connector_class
    by_name: Callable[[str], type] = factory.get_connector_class_by_name
    registry: dict[str, Any] = factory._registry

    def get_connector_class(cls: Any, kv_transfer_config: Any) -> type:
        return connector_class(by_config, registry, kv_transfer_config)

    def get_connector_class_by_name(cls: Any, connector_name: str) -> type:
        if connector_name.startswith(PREFIX):
            return _adapter_class(connector_name[len(PREFIX) :], plugin_name=True)
        return by_name(connector_name)

    factory.get_connector_class = classmethod(get_connector_class)
    factory.get_connector_class_by_name = classmethod(get_connector_class_by_name)
    factory._kvx_hooked = True


def connector_class(
    vllm_lookup: Callable[[Any], type], registry: dict[str, Any], kv_transfer_config: Any
) -> type:
    """The class vLLM builds for `kv_transfer_config`: vLLM's resolution (a non-empty
    `kv_connector_module_path` first, then the factory's names), with a kvx connector class
    hosted in the adapter and its config checked."""
    from kvx.adapters import vllm_lookup as lookup
    from kvx.adapters.vllm_config import GENERIC_CLASS

    name = kv_transfer_config.kv_connector
    module_path = kv_transfer_config.kv_connector_module_path
    if not name or module_path == "":
        return vllm_lookup(kv_transfer_config)  # vLLM's own message for these
    if module_path == ADAPTER_MODULE and name != GENERIC_CLASS:
        found = _adapter_class(name)
    elif module_path:
        try:
            module = lookup.import_module(module_path, "kv_connector_module_path")
            found = lookup.class_in(module, module_path, name, "kv_connector")
        except (ImportError, AttributeError) as exc:
            hint = _registered_name_hint(name)
            if hint:
                raise type(exc)(f"{exc}; {hint}") from None
            raise
        if lookup.is_kvx_connector_class(found):
            found = _adapter_class(f"{module_path}:{name}")
        elif not _is_adapter_class(found):
            return vllm_lookup(kv_transfer_config)
    elif name.startswith(PREFIX):
        found = _adapter_class(name[len(PREFIX) :], plugin_name=True)
    elif name in registry:
        found = vllm_lookup(kv_transfer_config)
    else:
        raise KvxConnectorError(_unknown_name(name, registry))
    if _is_adapter_class(found):
        _check(found, kv_transfer_config)
    return found


def _is_adapter_class(value: Any) -> bool:
    adapter = sys.modules.get(ADAPTER_MODULE)  # never imported: nothing can be its class
    return (
        adapter is not None and isinstance(value, type) and issubclass(value, adapter.KvxConnector)
    )


def _adapter_class(reference: str, plugin_name: bool = False) -> type:
    """The adapter class hosting kvx connector `reference`, or kvx's message about it
    (`plugin_name`: the config said `kvx.<reference>`)."""
    from kvx.adapters import vllm_lookup as lookup
    from kvx.errors import ConfigError
    from kvx.registry.core import get_registry

    try:
        from kvx.adapters.vllm import connector_class as adapter_class

        return adapter_class(reference)
    except ConfigError as exc:
        registry = get_registry()
        if plugin_name and reference not in lookup.known_names(registry):
            message = lookup.unknown_connector(PREFIX + reference, registry, PREFIX)
        else:
            message = "; ".join(p.message for p in exc.problems)
        raise KvxConnectorError(f"kv_connector {message}") from None


def _check(adapter_class: Any, kv_transfer_config: Any) -> None:
    """The hosted connector's config, checked as kvx checks it (one line on failure: the
    operator reads the last line of a traceback)."""
    from kvx.errors import ConfigError

    try:
        adapter_class.check_config(kv_transfer_config)
    except ConfigError as exc:
        problems = "; ".join(str(p) for p in exc.problems)
        raise KvxConnectorError(f"invalid KV transfer config: {problems}") from None


def _registered_name_hint(name: str) -> str:
    """How to name a registered kvx connector, when a module path failed to give it."""
    from kvx.adapters.vllm_lookup import known_names
    from kvx.errors import quote
    from kvx.registry.core import get_registry

    if name not in known_names(get_registry()):
        return ""
    return (
        f"{quote(name)} is a registered kvx connector: its module path is "
        f"{quote(ADAPTER_MODULE)}, or name it {quote(PREFIX + name)} without a module path"
    )


def _unknown_name(name: str, registry: dict[str, Any]) -> str:
    """`name` is neither vLLM's nor kvx's (and no module path was given)."""
    from kvx.adapters.vllm_lookup import known_names, registered_hint
    from kvx.errors import did_you_mean, quote, quoted_list
    from kvx.registry.core import get_registry

    kvx_registry = get_registry()
    bare = known_names(kvx_registry)
    theirs = sorted(n for n in registry if not n.startswith(PREFIX))
    mine = [PREFIX + n for n in bare]
    if name in bare:
        return (
            f"kv_connector {quote(name)} is a kvx connector, not one of vLLM's: name it "
            f'{quote(PREFIX + name)}, or add "kv_connector_module_path": "{ADAPTER_MODULE}"'
        )
    return (
        f"kv_connector {quote(name)} is not a connector vLLM knows"
        f"{did_you_mean(name, theirs + mine)}; vLLM's: {quoted_list(theirs)}; kvx's: "
        f"{quoted_list(mine) or 'none'}; {registered_hint(kvx_registry)}"
    )
