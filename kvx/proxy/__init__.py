"""`kvx proxy`: a disaggregated-serving proxy in front of prefill (P) and decode (D) servers.

Each completion request is prefilled on a P server and decoded on a D server, which loads the
KV cache P computed (see `kvx.proxy.forward`). Servers are health-checked, chosen round-robin
or by fewest requests in flight, and can be added or removed at run time (`ServerPool`).

Needs the `proxy` extra (`pip install 'kvx[proxy]'`) for `build_app`, `serve` and
`serve_in_thread`; the settings and the pool import without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvx.proxy.config import ROUTING_POLICIES, ProxyConfig, ProxySettingError
from kvx.proxy.pool import Health, Role, ServerPool, Upstream

if TYPE_CHECKING:
    from kvx.proxy.app import build_app
    from kvx.proxy.server import RunningProxy, serve, serve_in_thread

_NEEDS_EXTRA = {
    "build_app": "kvx.proxy.app",
    "serve": "kvx.proxy.server",
    "serve_in_thread": "kvx.proxy.server",
    "RunningProxy": "kvx.proxy.server",
}

__all__ = [
    "ROUTING_POLICIES",
    "Health",
    "ProxyConfig",
    "ProxySettingError",
    "Role",
    "RunningProxy",
    "ServerPool",
    "Upstream",
    "build_app",
    "serve",
    "serve_in_thread",
]


def __getattr__(name: str) -> Any:
    if name in _NEEDS_EXTRA:
        return getattr(importlib.import_module(_NEEDS_EXTRA[name]), name)
    raise AttributeError(f"module 'kvx.proxy' has no attribute {name!r}")
