"""Creating a NIXL agent: `nixl` is imported here, when a worker is built, never before."""

from __future__ import annotations

from typing import Any

from kvx import MissingDependencyError


def make_agent(name: str, backends: list[str], num_threads: int) -> Any:
    """A NIXL agent without a progress thread (on few cores it halves throughput and starves
    torch; workers poll instead)."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as exc:
        raise MissingDependencyError(
            f"NixlConnector needs NIXL, which failed to import ({exc}); install it with "
            "pip install 'kvx[nixl]'"
        ) from None
    config = nixl_agent_config(
        enable_prog_thread=False, backends=list(backends), num_threads=num_threads
    )
    agent = nixl_agent(name, config)
    missing = [b for b in backends if b not in agent.backends]
    if missing:
        raise MissingDependencyError(
            f"NIXL backend(s) {missing} could not be created; available plugins: "
            f"{agent.get_plugin_list()}"
        )
    return agent
