"""OffloadingConnector: offloads KV chunks to a CPU tier (LRU or ARC) and loads them back async.

The connector (which needs torch) is imported on first access: the registry imports this
package for its plugin record, and `kvx list` / `kvx validate` should not pay for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvx.plugins.offload.connector import OffloadingConnector

__all__ = ["OffloadingConnector"]


def __getattr__(name: str) -> Any:
    if name == "OffloadingConnector":
        return importlib.import_module("kvx.plugins.offload.connector").OffloadingConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
