"""Creating a NIXL agent: `nixl` is imported here, when a worker is built, never before."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from kvx import ConfigError, ConfigProblem, MissingDependencyError, install_hint
from kvx.plugins.nixl.interfaces import UCX_NET_DEVICES, interface_of

UCX_MODULES = "UCX_MODULES"
# UCX's EFA module links the host's own libefa/libibverbs, which bring the host's libnl-route next
# to the copy bundled in the nixl wheel; the two copies' destructors then crash every process at
# exit (SIGSEGV, exit 139) on any host with libibverbs1 and its providers installed. Every other
# UCX module, the InfiniBand/mlx5 ones included, uses the wheel's own verbs stack and stays on.
DEFAULT_UCX_MODULES = "^efa"


@contextlib.contextmanager
def _ucx_environment(listen_host: str) -> Iterator[None]:
    """UCX reads its environment when a backend starts: for that moment only, keep its TCP
    transport on `listen_host`'s interface and leave out the EFA module, each unless the operator
    set the variable (`UCX_NET_DEVICES`, `UCX_MODULES`) themselves."""
    defaults: dict[str, str] = {}
    if os.environ.get(UCX_NET_DEVICES) is None:
        try:
            interface = interface_of(listen_host)
        except ValueError as exc:
            raise ConfigError(
                [ConfigProblem("kv_connector_extra_config.side_channel_host", str(exc))]
            ) from None
        if interface is not None:
            defaults[UCX_NET_DEVICES] = interface
    if os.environ.get(UCX_MODULES) is None:
        defaults[UCX_MODULES] = DEFAULT_UCX_MODULES
    os.environ.update(defaults)
    try:
        yield
    finally:
        for name in defaults:
            os.environ.pop(name, None)


def make_agent(name: str, backends: list[str], num_threads: int, listen_host: str) -> Any:
    """A NIXL agent without a progress thread (on few cores it halves throughput and starves
    torch; workers poll instead) whose UCX transport listens only on the interface holding
    `listen_host` and loads no EFA module (see `_ucx_environment`)."""
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
    with _ucx_environment(listen_host):
        agent = nixl_agent(name, config)
    missing = [b for b in backends if b not in agent.backends]
    if missing:
        raise MissingDependencyError(
            f"NIXL backend(s) {missing} could not be created; available plugins: "
            f"{agent.get_plugin_list()}"
        )
    return agent
