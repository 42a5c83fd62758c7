"""Creating a NIXL agent: `nixl` is imported here, when a worker is built, never before."""

from __future__ import annotations

import os
from typing import Any

from kvx import ConfigError, ConfigProblem, MissingDependencyError, install_hint
from kvx.plugins.nixl.interfaces import UCX_NET_DEVICES, interface_of


def make_agent(name: str, backends: list[str], num_threads: int, listen_host: str) -> Any:
    """A NIXL agent without a progress thread (on few cores it halves throughput and starves
    torch; workers poll instead) whose UCX transport listens only on the interface holding
    `listen_host` (unless the operator set `UCX_NET_DEVICES` themselves)."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as exc:
        raise MissingDependencyError(
            f"NixlConnector needs NIXL, which failed to import ({exc}); install it with "
            f"{install_hint('nixl', 'nixl')}"
        ) from None
    config = nixl_agent_config(
        enable_prog_thread=False, backends=list(backends), num_threads=num_threads
    )
    devices = os.environ.get(UCX_NET_DEVICES)
    if devices is None:
        try:
            interface = interface_of(listen_host)
        except ValueError as exc:
            raise ConfigError(
                [ConfigProblem("kv_connector_extra_config.side_channel_host", str(exc))]
            ) from None
        if interface is not None:
            os.environ[UCX_NET_DEVICES] = interface  # UCX reads it when the backend starts
    try:
        agent = nixl_agent(name, config)
    finally:
        if devices is None:
            os.environ.pop(UCX_NET_DEVICES, None)
    missing = [b for b in backends if b not in agent.backends]
    if missing:
        raise MissingDependencyError(
            f"NIXL backend(s) {missing} could not be created; available plugins: "
            f"{agent.get_plugin_list()}"
        )
    return agent
