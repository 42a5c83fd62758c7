"""OffloadingConnector: a CPU tier for KV blocks with LRU or ARC eviction."""

from kvx.plugins.offload.connector import OffloadingConnector

__all__ = ["OffloadingConnector"]
